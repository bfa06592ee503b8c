"""Host-verified speculative rounds (``speculate``): each round fires the drafts with a readout on every row
and verifies them here (docs/architecture.md, "Speculative decoding as inferlets"):

    drafts = drafter.propose(seq, k)                     # may be [] → a plain step, window [last]
    res = fire([last] + drafts, readout on every row, fold=DEFERRED)
    v = verify(drafts, res)                              # accepted drafts + one target token
    ws.settle(1 + v.accepted)                            # commit `last` and the accepted drafts only,
                                                         # carried by the next fire (no extra message)
    output.push(v.tokens)                                # cut at EOS / stop string / token limit

A tree proposal is fired as one tree window and verified along its paths (inferlet.tree). A run whose sampler
needs every step's logits (penalties, a logit bias, logprobs) never speculates: it reads Logits and samples
here (the fallback, inferlet.sampler.PlainSampler). ``n > 1`` runs the loop once per choice on forks of the
prompt (inferlet.choices), each with a drafter of its own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from ..errors import ArgumentError
from ..forward import DEFERRED, ForwardPass
from ..model import Model
from ..readouts import Logits
from ..sampler import PlainSampler
from ..text.arguments import DecodeArgs
from ..text.choices import run_choices
from ..working_set import WorkingSet
from .drafter import Drafter, Proposal
from .drafting import drive_rounds
from .rounds import Run
from .token_tree import TokenTree
from .verifier import Verifier

DrafterFactory = Callable[[DecodeArgs], Drafter]  # a choice's args → its drafter


async def speculate(
    model: Model,
    args: DecodeArgs,
    drafter: Drafter | DrafterFactory,
    k: int,
    verifier: Verifier | None = None,
    ws: WorkingSet | None = None,
) -> dict:
    """Runs host-verified rounds (module docstring) with up to ``k`` drafts a round; returns the inferlet result,
    with ``args.n`` choices when it asks for more than one. ``drafter`` is a Drafter or a factory of one per
    choice's args; an n > 1 run given one Drafter decodes each further choice with a deep copy of it, made
    before the run starts (a drafter holding engine resources, a draft model's working set, is given as a
    factory). Pass ``verifier`` when the drafter samples too, so both draw from one seeded generator (one
    choice only), and ``ws`` to start on a working set holding the prompt's head (a choice's fork)."""
    if args.n > 1 and ws is None:
        if verifier is not None:
            raise ArgumentError("this inferlet's sampling drafter decodes one choice: run it with --n 1")
        drafters = choice_drafters(drafter, args)
        return await run_choices(model, args, lambda a, fork: one_choice(model, a, drafters(a), k, None, fork))
    return await one_choice(model, args, drafter if isinstance(drafter, Drafter) else drafter(args), k, verifier, ws)


def choice_drafters(drafter: Drafter | DrafterFactory, args: DecodeArgs) -> DrafterFactory:
    """A drafter per choice of ``args``: the factory's, or ``drafter`` for choice 0 and copies of it, made now
    while it is fresh, for the others."""
    if not isinstance(drafter, Drafter):
        return drafter
    copies = iter([drafter] + [copy.deepcopy(drafter) for _ in range(args.n - 1)])
    return lambda a: next(copies)  # run_choices starts the choices in order


async def one_choice(
    model: Model, args: DecodeArgs, drafter: Drafter, k: int, verifier: Verifier | None, ws: WorkingSet | None
) -> dict:
    """One choice's rounds (``speculate`` for n == 1)."""
    run = Run.start(model, args, ws)
    out, stats, ws = run.out, run.stats, run.ws
    verifier = verifier or Verifier(args)
    fallback = args.fallback_reasons()
    plain = PlainSampler(args, run.prompt, verifier.rng) if fallback else None
    if plain is not None and args.top_count is not None:
        out.track_logprobs(plain.logprobs)

    async def step(window: list[int], proposal: Proposal) -> list[int]:
        """One fire over ``window`` (whose last len(drafts) rows are the drafts); returns the emitted tokens."""
        if proposal.tree is not None and plain is None:
            return await tree_step(window[-1], proposal.tree)
        drafts, q = proposal.tokens, proposal.q
        rows = list(range(len(window) - len(drafts) - 1, len(window)))
        fp = ForwardPass(ws).embed(window)
        masks = drafter.masks(drafts)
        for kind in [Logits()] if plain is not None else drafter.readouts(verifier):
            fp.readout(rows, kind, masks)
        fp.fold(DEFERRED if drafts else len(window))
        res = await run.fire(fp)
        if plain is not None:
            logits = res.logits
            assert logits is not None  # the Logits readout
            return [plain.choose(logits[0], out.ids)]
        v = verifier.verify(drafts, res.readouts[0], q)
        drafter.observe(res, v)
        if drafts:
            stats.record(v)
            ws.settle(len(window) - len(drafts) + v.accepted)
        return v.tokens

    async def tree_step(last: int, tree: TokenTree) -> list[int]:
        """One tree window ``[last] + tree``, a readout on every row, verified; folds the kept path."""
        tokens, parents = tree.window(last)
        fp = ForwardPass(ws).embed(tokens).tree(parents)
        for kind in drafter.readouts(verifier):
            fp.readout(range(len(tokens)), kind)
        fp.fold(DEFERRED)
        res = await run.fire(fp)
        v = verifier.verify_tree(tree, res.readouts[0])
        drafter.observe(res, v)
        stats.record_tree(v, tree.max_depth)
        ws.settle(v.path)
        return v.tokens

    await drive_rounds(run, drafter, k, step, fallback)
    if plain is not None and args.top_count is not None:
        run.logprobs = plain.logprobs
    return await run.finish()
