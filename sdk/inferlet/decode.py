"""The round loop of the speculative inferlets: a run's state (``Run``), the loop (``drive_rounds``) and the
host-verified round (``speculate``). What plugs into it lives beside it: the ``Drafter`` (inferlet.drafter),
the ``Verifier`` and the fallback's ``PlainSampler`` (inferlet.sampler), the ``Output`` cut
(inferlet.output), the arguments (inferlet.args.DecodeArgs).

One round (docs/architecture.md, "Speculative decoding as inferlets"):

    drafts = drafter.propose(seq, k)                     # may be [] → a plain step, window [last]
    res = fire([last] + drafts, readout on every row, fold=DEFERRED)
    v = verify(drafts, res)                              # accepted drafts + one target token
    ws.settle(1 + v.accepted)                            # commit `last` and the accepted drafts only,
                                                         # carried by the next fire (no extra message)
    output.push(v.tokens)                                # cut at EOS / stop string / token limit

Terms:
    room          tokens the output may still take (max_tokens minus those emitted);
    plain step    a round without drafts; its reason is counted in ``stats.skipped`` (``no_draft``: the
                  drafter had none; ``draft_cost``: the draft-length planner expected drafting to be slower);
    fallback      a run that never speculates because its sampler needs every step's logits
                  (penalties, a logit bias, logprobs): it reads Logits and samples here; every step counts
                  the reason in ``stats.skipped`` (and the result's ``speculation.skipped``).

A run may start on a working set that already holds the prompt but its last token (a fork, one choice of an
n > 1 request: inferlet.choices): its prefill fire embeds only the rows the working set lacks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

from .args import DecodeArgs
from .draft_length import DraftPlanner
from .drafter import Drafter, Proposal
from .forward import DEFERRED, ForwardPass
from .model import Model
from .output import Output
from .readouts import Logits
from .runtime import inferlet_name
from .sampler import PlainSampler, Verifier
from .speculative import SpecStats
from .tree import TokenTree
from .working_set import WorkingSet

# step(window, proposal) fires ``window`` (its last proposal.tokens rows are a chain's drafts; a tree proposal's
# window is [last] and the tree's rows follow it) and returns the emitted tokens
Step = Callable[[list[int], Proposal], Awaitable[list[int]]]


@dataclass
class Run:
    """The state of one speculative run, and the result it builds."""

    model: Model
    args: DecodeArgs
    prompt: list[int]
    out: Output
    ws: WorkingSet
    stats: SpecStats = field(default_factory=SpecStats)
    prefill_ms: float = 0.0
    decode_s: float = 0.0
    round_ms: list[float] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)
    overhead_ms: float | None = None  # the planner's last estimate of a round's overhead (adaptive schedule)
    plain_overhead_ms: float | None = None  # ... and of a plain round's, once one was timed
    logprobs: list[dict] | None = None

    @classmethod
    def start(cls, model: Model, args: DecodeArgs, ws: WorkingSet | None = None) -> Run:
        """A run of ``args``: its prompt tokenized, an empty Output cut at the model's capacity, and ``ws`` or a
        new working set (opened in the engine by the prefill)."""
        prompt = args.prompt_ids(model.tokenizer)
        out = Output(model.tokenizer, args, len(prompt), model.max_positions)
        return cls(model, args, prompt, out, ws if ws is not None else model.working_set())

    async def finish(self) -> dict:
        """Reports the run's counters to the engine (summed in its ``stats``), then returns the result."""
        self.stats.replayed_rows = self.ws.replayed_rows
        await self.model.client.request(
            "spec_report",
            model=self.model.name,
            inferlet=inferlet_name(),
            **asdict(self.stats),
            decode_tokens=max(len(self.out.ids) - 1, 0),
            decode_s=self.decode_s,
            prefill_ms=self.prefill_ms,
        )
        return self.result()

    def result(self) -> dict:
        decoded = max(len(self.out.ids) - 1, 0)  # the first token came with the prefill
        rate = round(decoded / self.decode_s, 2) if self.decode_s > 0 and decoded else 0.0
        stats = {
            "prompt_tokens": len(self.prompt),
            "generated_tokens": len(self.out.ids),
            "cached_tokens": min(self.ws.cached_rows, len(self.prompt)),
            "kv_pages": self.ws.pages,  # KV pages held at the end (the last fire's), and the most held at once
            "kv_pages_max": self.ws.pages_max,
            "kv_bytes": self.ws.kv_bytes,  # bytes of KV held at the end, and the most held at once
            "kv_bytes_max": self.ws.kv_bytes_max,
            **self.stats.as_dict(rate, round(self.prefill_ms, 2)),
        }
        if self.args.timing:
            stats["round_ms"] = [round(t, 3) for t in self.round_ms]
            stats["draft_ms"] = [round(t, 3) for t in self.draft_ms]
            if self.overhead_ms is not None:
                stats["overhead_ms"] = round(self.overhead_ms, 3)
            if self.plain_overhead_ms is not None:
                stats["plain_overhead_ms"] = round(self.plain_overhead_ms, 3)
        res = {**self.out.result(), "stats": stats, "speculation": self.stats.summary()}
        if self.logprobs is not None:
            res["logprobs"] = self.logprobs
        return res


async def drive_rounds(run: Run, drafter: Drafter, k: int, step: Step, fallback: list[str]) -> None:
    """The round loop shared by every way of verifying: prefill, then per round choose the drafts (or say in
    ``stats.skipped`` why there are none) and ``await step(window, drafts, q)`` for the emitted tokens, until the
    output is done. ``fallback`` (reasons a run never speculates) makes every round a plain step.
    Up to ``k`` drafts a round: with ``draft_schedule=adaptive`` the planner's count for this round.
    Records prefill and decode times, and releases the working set and the drafter at the end."""
    model, out, stats, ws = run.model, run.out, run.stats, run.ws
    costs = model.pass_cost_ms if run.args.draft_schedule == "adaptive" else []
    planner = drafter.planner = DraftPlanner(
        k,
        costs,
        drafter.draft_cost_ms,
        replay=model.recurrent,
        free_fold_rows=model.per_row_states,
        prior=drafter.acceptance_prior,
    )
    if model.state_granule > 1:  # every fire folds all its rows: no round can leave a draft out
        fallback = [*fallback, "granule"]
    prompt = list(run.prompt)
    seq = list(prompt)
    try:
        t0 = time.perf_counter()
        window = prompt[ws.committed :]  # a fork holds all but the prompt's last token already
        if fallback:
            new = await step(window, Proposal())
        else:
            new, _ = await asyncio.gather(step(window, Proposal()), drafter.prefill(prompt))
        run.prefill_ms = (time.perf_counter() - t0) * 1e3
        run.round_ms.clear()
        t_decode = t_round = time.perf_counter()
        while True:
            taken = new[: out.push(new)]
            seq += taken
            await drafter.commit(taken, seq, ws.committed)
            if out.done:
                break
            proposal = Proposal()
            if fallback:
                for reason in fallback:
                    stats.skip(reason)
            elif out.room <= 1:
                stats.skip("last_token")  # only the bonus token is left to emit
            elif ws.committed + 1 + k > model.max_positions:
                stats.skip("near_capacity")  # a full verify window would not fit
            elif (want := planner.next()) == 0 and k > 0:
                stats.skip("draft_cost")  # the planner expects a plain step to be faster at this acceptance
            else:
                t = time.perf_counter()
                proposal = await drafter.propose(seq, min(want, out.room - 1))
                proposal = fit_tree(proposal, out.room - 1, model.max_positions - ws.committed - 1)
                run.draft_ms.append((time.perf_counter() - t) * 1e3)
                if not proposal.rows:
                    stats.skip("no_draft")
            new = await step([seq[-1]] + proposal.tokens, proposal)
            if proposal.tree is not None:
                planner.observe_tree(proposal.tree.max_depth, len(new) - 1)
            else:
                planner.observe(len(proposal.tokens), len(new) - 1)
            planner.observe_load(ws.step_rows, 1 + proposal.rows)
            t_now = time.perf_counter()
            planner.observe_time((t_now - t_round) * 1e3, ws.step_rows, proposal.rows)
            t_round = t_now
        run.decode_s = time.perf_counter() - t_decode
        run.overhead_ms = planner.overhead_ms if planner.adaptive and planner.residuals else None
        run.plain_overhead_ms = planner.overhead(0) if planner.adaptive and planner.plain_residuals else None
    finally:
        await drafter.close()
        await ws.release()


def fit_tree(proposal: Proposal, depth: int, rows: int) -> Proposal:
    """A tree proposal cut to what the round may use: no node deeper than ``depth`` (the output's room less the
    target's own token), at most ``rows`` draft rows (the model's capacity). A tree that is a chain becomes one."""
    tree = proposal.tree
    if tree is None:
        return proposal
    tree = tree.pruned(depth, rows)
    if not len(tree):
        return Proposal()
    if tree.is_chain() and not tree.child_q:
        return Proposal(tree.chain())
    return Proposal(tree=tree)


async def speculate(
    model: Model,
    args: DecodeArgs,
    drafter: Drafter,
    k: int,
    verifier: Verifier | None = None,
    ws: WorkingSet | None = None,
) -> dict:
    """Runs the round loop (module docstring) with up to ``k`` drafts a round; returns the inferlet result.
    Pass ``verifier`` when the drafter samples too, so both draw from one seeded generator, and ``ws`` to start
    on a working set holding the prompt's head (a choice's fork)."""
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
        t0 = time.perf_counter()
        res = await fp.submit()
        run.round_ms.append((time.perf_counter() - t0) * 1e3)
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
        t0 = time.perf_counter()
        res = await fp.submit()
        run.round_ms.append((time.perf_counter() - t0) * 1e3)
        v = verifier.verify_tree(tree, res.readouts[0])
        drafter.observe(res, v)
        stats.record_tree(v, tree.max_depth)
        ws.settle(v.path)
        return v.tokens

    await drive_rounds(run, drafter, k, step, fallback)
    if plain is not None and args.top_count is not None:
        run.logprobs = plain.logprobs
    return await run.finish()
