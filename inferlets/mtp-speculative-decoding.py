"""mtp-speculative-decoding: the model's multi-token-prediction head drafts, one fire a round.

Gloeckle et al. 2024, "Better & Faster Large Language Models via Multi-token Prediction";
DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (MTP modules used for speculative decoding).

    res = fire([last, d_1..d_k], readout MTP(k) on every row, fold=DEFERRED)
    # MTP tokens (k+1, 1+k): column 0 is the target's argmax at the row, columns 1..k chained drafts
    # (greedy: at_accepted, so the engine chains only from the row verification stops at)
    v = verify(drafts, column 0)   (sampled: a Distribution readout too, point-mass q)
    ws.fold(1 + v.accepted);  next drafts = MTP tokens[v.accepted, 1..k] when the emitted token is column 0

With --tree W1,W2,.. (widths per depth; Medusa's tree, Cai et al. 2024) the fire reads MTP(depth) with
its draft distributions on every row, and the next round verifies the tree whose depth-d nodes each have the
top-W_(d+1) tokens of the head's depth-(d+1) distribution at the last kept row as children, in one tree window
(inferlet.tree). The draft-length planner keeps chains while it expects more tokens per millisecond from them.

With --run-ahead (greedy) the loop stays in the engine: the window comes from a channel, the epilogue
verifies (n = cumprod(drafts == target[:k]).sum()), folds n + 1, writes target[0..n] to an output channel
and the next window [target[n], MTP drafts at row n] to the input (sdk/inferlet/device_rounds.py); this
inferlet only takes the output and replays the host loop's stats from it. Sampled runs use the host loop.
Run-ahead drafts --draft-length every round: the adaptive schedule (inferlet.draft_length) is host-side.
n > 1 (forks of the prompt, inferlet.choices) and ignore_eos (the engine loop stops at EOS) use the host loop.
"""

from __future__ import annotations

import numpy as np

import inferlet
from inferlet.args import DecodeArgs
from inferlet.chained import next_depth
from inferlet.choices import run_choices
from inferlet.decode import speculate
from inferlet.device_rounds import mtp_run_ahead
from inferlet.drafter import Drafter, Proposal
from inferlet.sampler import Verifier
from inferlet.speculative import VerifyResult
from inferlet.tree import TokenTree, TreeVerdict, parse_shape, shape_rows


class Args(DecodeArgs):
    draft_length: int  # required: at most the model's MTP depth
    run_ahead: bool = False  # greedy: the whole loop in the engine
    tree: str | None = None  # widths per depth, e.g. "3,2,1": draft a tree of the head's top-k per depth


class MTPDrafter(Drafter):
    """Each fire's MTP readout drafts the next round. Its depth is the most drafts the planner could ask for
    next round, whatever this round's verdict (``next_depth``), since every level of depth costs an MTP step
    and an lm head whether or not its draft is used; before a round the planner will not draft in, the fire
    reads out no MTP at all."""

    def __init__(self, k: int, step_ms: float = 0.0, widths: list[int] | None = None):
        self.k = k
        self.proposed = 0  # chain drafts the fire being built verifies
        self.next: list[int] = []
        self.next_tree: TokenTree | None = None
        self.draft_cost_ms = step_ms
        self.widths = widths[:k] if widths else None
        self.tree_fire = False  # the fire being built verifies a tree (at_accepted reads chains only)
        self.reading_tree = False  # the fire being built reads the next round's tree

    def readouts(self, verifier: Verifier) -> list:
        self.reading_tree = False
        depth = next_depth(self, self.proposed, self.k)
        if depth == 0:
            return [verifier.kind()]  # the next round is a plain step: no drafts to compute for it
        w = self.widths
        # reading the tree's distributions costs an MTP chain on every row of this fire, not on one
        if w is not None and (
            self.planner is None or self.planner.use_tree(w, shape_rows(w), (shape_rows(w) + 1) * len(w))
        ):
            self.reading_tree = True  # the head's distributions at every row: the top-k per depth
            mtp = inferlet.MTP(len(w), with_probs=True)
            return [mtp] if verifier.greedy else [verifier.kind(), mtp]
        if verifier.greedy and not self.tree_fire:  # the engine chains drafts only from the kept row
            return [inferlet.MTP(depth, at_accepted=True)]
        return [verifier.kind(), inferlet.MTP(depth)]

    def observe(self, res: inferlet.PassResult, verified: VerifyResult | TreeVerdict) -> None:
        self.next, self.next_tree, self.tree_fire, self.proposed = [], None, False, 0
        if res.readouts[-1].kind != "mtp":
            return
        row = verified.path[-1] if isinstance(verified, TreeVerdict) else verified.accepted
        readout = res.readouts[-1]
        tokens = readout.tokens[row]  # (1+depth,) at the last kept row
        # the drafts follow column 0; a sampled token that differs from it leaves none
        if int(tokens[0]) != verified.tokens[-1] or min(tokens[1:], default=0) < 0:
            return
        if self.reading_tree and self.widths is not None and readout.probs is not None:
            cands = [np.argsort(-readout.probs[row, d], kind="stable")[:w].tolist() for d, w in enumerate(self.widths)]
            self.next_tree = TokenTree.from_topk(cands, self.widths)
        else:
            self.next = [int(t) for t in tokens[1:]]

    async def propose(self, seq: list[int], k: int) -> Proposal:
        self.tree_fire = self.next_tree is not None
        if self.next_tree is not None:
            return Proposal(tree=self.next_tree)
        self.proposed = min(k, len(self.next))
        return Proposal(self.next[:k])


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    model.require_mtp(args.draft_length)
    widths = parse_shape(args.tree) if args.tree else None
    if widths is not None:
        model.require_mtp(len(widths))
    if args.run_ahead and args.n == 1 and not args.ignore_eos and widths is None:
        return await mtp_run_ahead(model, args, MTPDrafter(args.draft_length), args.draft_length)
    return await run_choices(
        model,
        args,
        lambda a, ws: speculate(model, a, MTPDrafter(a.draft_length, model.mtp_step_ms, widths), a.draft_length, ws=ws),
    )
