"""draft-model-speculative-decoding: a small model with the target's tokenizer drafts, the target verifies.

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling".

    draft ws: fire(the tokens it lacks, fold all) → d_1 ~ q_1 (argmax when greedy)
              fire([d_1 .. d_i], fold 0)       → d_(i+1), for i = 1..k-1
    res = fire(target ws, [last, d_1..d_k], readout every row, fold=DEFERRED)
    v = verify(drafts, p, q)          # accept with min(1, p/q), resample max(0, p - q) on rejection
    target: ws.fold(1 + v.accepted)

With --tree W1,W2,.. (widths per depth) the draft model branches: its first fire reads the distribution after
`last` and the root gets W1 children (greedy: its top-W1; sampled: W1 draws without replacement, which the
target verifies by recursive rejection sampling, inferlet.spec.TokenTree); each further fire embeds the tree so far as a
tree window (fold nothing) and gives every deepest node W_(d+1) children the same way. One target fire then
verifies the whole tree and folds the kept path.

The draft's working set folds only tokens of the sequence (the target's output); its draft rows stay
unfolded, so a rejected draft never has to be taken back. The price is that each chained fire re-embeds the
drafts before it (a window of i rows for draft i+1), which costs about one row on a CPU for the small
windows drafting uses, and the accepted drafts are embedded again with the next round's missing tokens.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

import inferlet
from inferlet.spec import (
    ROOT,
    Drafter,
    Proposal,
    TokenTree,
    Verifier,
    draw_without_replacement,
    parse_shape,
    shape_rows,
    speculate,
)
from inferlet.text import MAX_DRAFT, DecodeArgs, TreeShape, draw, run_choices


class Args(DecodeArgs):
    draft: str | None = None  # a model in the store, served by the same engine (default: the attached one)
    draft_length: int = Field(default=4, ge=0, le=MAX_DRAFT)
    tree: TreeShape = None  # widths per depth, e.g. "2,2,1": the draft model's top-k (or draws) per depth


class ModelDrafter(Drafter):
    """Drafts with a second model in its own working set, which holds exactly the sequence's final tokens."""

    def __init__(self, model: inferlet.Model, verifier: Verifier, widths: list[int] | None = None):
        self.ws = model.working_set()
        self.verifier = verifier
        self.widths = widths
        # a draft is one 1-row pass of the draft model plus its round trip (for the draft-length planner)
        self.draft_cost_ms = model.pass_cost_ms[0] + 1.0 if model.pass_cost_ms else 0.0

    async def prefill(self, prompt: list[int]) -> None:
        if len(prompt) > 1:
            await inferlet.ForwardPass(self.ws).embed(prompt[:-1]).submit()  # its last token comes with a round

    async def propose(self, seq: list[int], k: int) -> Proposal:
        w = self.widths
        if w is not None and self.tree_pays(w, shape_rows(w), len(w)):
            return Proposal(tree=await self.propose_tree(seq, w))
        lacking = seq[self.ws.committed :]  # final tokens the draft has not seen, ending with `last`
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        for i in range(k):
            window = lacking if i == 0 else drafts  # chained fires re-embed the unfolded drafts
            fp = inferlet.ForwardPass(self.ws).embed(window)
            fp.readout([len(window) - 1], self.verifier.kind())
            fp.fold(len(window) if i == 0 else 0)
            res = await fp.submit()
            if self.verifier.greedy:
                drafts.append(int(res.tokens[0]))
            else:
                qs.append(res.probs[0])
                drafts.append(draw(qs[-1], self.verifier.rng))
        return Proposal(drafts, np.stack(qs) if qs else None)

    async def propose_tree(self, seq: list[int], widths: list[int]) -> TokenTree:
        """A tree of ``widths``, one draft fire per depth (module docstring)."""
        kind = inferlet.Distribution(1.0) if self.verifier.greedy else self.verifier.kind()
        lacking = seq[self.ws.committed :]
        res = await inferlet.ForwardPass(self.ws).embed(lacking).readout([len(lacking) - 1], kind).submit()
        tree, frontier = TokenTree(), [ROOT]
        probs = res.probs
        for d, width in enumerate(widths):
            assert probs is not None  # the Distribution readout
            level = []
            for node, q in zip(frontier, probs):
                if self.verifier.greedy:
                    kids = [int(t) for t in np.argsort(-q, kind="stable")[:width]]
                else:
                    kids = draw_without_replacement(q, width, self.verifier.rng)
                    tree.child_q[node] = q
                level += [tree.add(node, t) for t in kids]
            frontier = level
            if d + 1 == len(widths) or not frontier:
                break
            fp = inferlet.ForwardPass(self.ws).embed(tree.tokens).tree(tree.parents)  # folds nothing
            probs = (await fp.readout(frontier, kind).submit()).probs
        return tree

    async def close(self) -> None:
        await self.ws.release()


@inferlet.main
async def main(args: Args) -> dict:
    target = inferlet.model()
    attached = [d["name"] for d in target.drafters if d["kind"] == "draft"]
    if args.draft is None and not attached:
        raise inferlet.UsageError(
            f"model {target.name} has no draft model attached: train one with `pie drafter train --model "
            f"{target.name} --kind draft --corpus TEXT --out {target.name}-draft --attach`, or name a store model "
            "with the target's tokenizer with --draft NAME"
        )
    draft = inferlet.model(args.draft or attached[0])
    if draft.vocab_size != target.vocab_size:
        raise inferlet.UsageError(f"draft {draft.name} has vocab {draft.vocab_size}, target {target.vocab_size}")

    async def choice(a: Args, ws: inferlet.WorkingSet) -> dict:
        verifier = Verifier(a)
        widths = parse_shape(a.tree) if a.tree else None
        return await speculate(target, a, ModelDrafter(draft, verifier, widths), a.draft_length, verifier, ws)

    return await run_choices(target, args, choice)
