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

With --lookup L the head shares the rounds with a prompt lookup (Saxena 2023; the hybrid of SuffixDecoding's
authors, Oliaro et al. 2024, with a model's drafter): when the last 3 or 2 tokens occurred earlier in the
prompt or the output, the round drafts up to L tokens that followed them, else the head's drafts. A copied
passage or a loop in the output then goes at the lookup's pace (many tokens a round) and free text at the
head's; every fire still reads the head's chain, so its drafts are there whenever the lookup finds nothing.
A lookup round's drafts cost nothing to make; the head's chain is paid every round and the planner sees it as
part of the round's measured overhead.

With --run-ahead (greedy) the loop stays in the engine: the window comes from a channel, the epilogue
verifies (n = cumprod(drafts == target[:k]).sum()), folds n + 1, writes target[0..n] to an output channel
and the next window [target[n], MTP drafts at row n] to the input (sdk/inferlet/spec/device_rounds.py); this
inferlet only takes the output and replays the host loop's stats from it. Sampled runs use the host loop.
Run-ahead drafts --draft-length every round: the adaptive schedule (inferlet.spec.draft_policy) is host-side.
n > 1 (forks of the prompt, inferlet.choices) and ignore_eos (the engine loop stops at EOS) use the host loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field

import inferlet
from inferlet.spec import (
    ChainedDrafter,
    NgramIndex,
    Proposal,
    TokenTree,
    TreeVerdict,
    Verifier,
    VerifyResult,
    mtp_run_ahead,
    parse_shape,
    shape_rows,
    speculate,
)
from inferlet.text import MAX_DRAFT, ArgumentError, DecodeArgs, TreeShape, run_choices


class Args(DecodeArgs):
    # at most the model's MTP depth; unset: that depth, the chain the head was trained and measured for (with the
    # adaptive schedule, the default, the planner then drafts up to it a round as the head's record says pays)
    draft_length: int | None = Field(default=None, ge=0, le=MAX_DRAFT)
    run_ahead: bool = False  # greedy: the whole loop in the engine
    tree: TreeShape = None  # widths per depth, e.g. "3,2,1": draft a tree of the head's top-k per depth
    lookup: int = Field(
        default=0, ge=0, le=MAX_DRAFT
    )  # > 0: prompt-lookup drafts of up to this many tokens where they match


LOOKUP_NGRAM = (2, 3)  # --lookup matches the last 3 tokens, else the last 2 (one token matches too much text)


class MTPDrafter(ChainedDrafter):
    """Each fire's MTP readout drafts the next round (inferlet.spec.chained: its depth is the policy's, weighed
    over this round's possible verdicts). With ``widths`` the fire may read the head's distributions on every
    row instead, for a tree; with ``lookup`` a prompt lookup's drafts go first where they match."""

    def __init__(
        self,
        k: int,
        step_ms: float = 0.0,
        widths: list[int] | None = None,
        lookup: int = 0,
        acceptance: Sequence[float] = (),
    ):
        # a lookup draft costs nothing, and the head's chain, run every fire, is then the round's overhead; the
        # head's training record (Model.mtp_acceptance) is the policy's prior unless lookups share the rounds
        super().__init__(mtp_head, k, 0.0 if lookup else step_ms, () if lookup else acceptance)
        # with --lookup: the text so far, n-gram indexed, and the longest lookup draft
        self.index = NgramIndex(LOOKUP_NGRAM[1], LOOKUP_NGRAM[0]) if lookup else None
        self.lookup = lookup
        self.next_tree: TokenTree | None = None
        self.widths = widths[:k] if widths else None
        self.tree_fire = False  # the fire being built verifies a tree (at_accepted reads chains only)
        self.reading_tree = False  # the fire being built reads the next round's tree

    def readouts(self, verifier: Verifier) -> list:
        self.reading_tree = False
        depth = self.chain_depth()
        w = self.widths
        # reading the tree's distributions costs an MTP chain on every row of this fire, not on one
        if depth and w is not None and self.tree_pays(w, shape_rows(w), (shape_rows(w) + 1) * len(w)):
            self.reading_tree = True  # the head's distributions at every row: the top-k per depth
            mtp = inferlet.MTP(len(w), with_probs=True)
            return [mtp] if verifier.greedy else [verifier.kind(), mtp]
        return self.chain_readouts(verifier, depth, at_accepted=not self.tree_fire)

    def observe(self, res: inferlet.PassResult, verified: VerifyResult | TreeVerdict) -> None:
        probs, widths = res.readouts[-1].probs, self.widths
        reading_tree = self.reading_tree
        super().observe(res, verified)
        self.next_tree, self.tree_fire = None, False
        if reading_tree and widths is not None and probs is not None and self.next:
            self.next = []  # the head's distributions at the kept row: the top-k per depth, a tree
            row = verified.path[-1] if isinstance(verified, TreeVerdict) else verified.accepted
            cands = [np.argsort(-probs[row, d], kind="stable")[:w].tolist() for d, w in enumerate(widths)]
            self.next_tree = TokenTree.from_topk(cands, widths)

    async def prefill(self, prompt: list[int]) -> None:
        if self.index is not None:
            self.index.extend(prompt)

    async def commit(self, new_tokens: list[int], seq: list[int], committed: int) -> None:
        if self.index is not None:
            self.index.extend(new_tokens)

    async def propose(self, seq: list[int], k: int) -> Proposal:
        self.tree_fire = self.next_tree is not None
        if self.next_tree is not None:
            return Proposal(tree=self.next_tree)
        found = self.index.draft(min(k, self.lookup)) if self.index is not None else []
        drafts = found or self.next[: min(k, self.k)]
        self.proposed = len(drafts)
        return Proposal(drafts)


def mtp_head(depth: int, at_accepted: bool) -> inferlet.MTP:
    """The head readout of a fire that chains ``depth`` drafts."""
    return inferlet.MTP(depth, at_accepted=at_accepted)


@inferlet.main
async def main(args: Args) -> dict:
    if args.lookup and (args.tree or args.run_ahead):
        raise ArgumentError("--lookup drafts chains on the host: it does not combine with --tree or --run-ahead")
    model = inferlet.model()
    if args.draft_length is None:
        model.require_mtp(1)  # says how to attach a head when there is none
    k = model.mtp_depth if args.draft_length is None else args.draft_length
    model.require_mtp(k)
    args = args.model_copy(update={"draft_length": k})
    widths = parse_shape(args.tree) if args.tree else None
    if widths is not None:
        model.require_mtp(len(widths))
    if args.run_ahead and args.n == 1 and not args.ignore_eos and widths is None:
        return await mtp_run_ahead(model, args, MTPDrafter(k), k)
    most = max(k, args.lookup) if k else 0  # --draft-length 0: plain steps

    def drafter(a: Args) -> MTPDrafter:
        return MTPDrafter(k, model.mtp_step_ms, widths, a.lookup, model.mtp_acceptance)

    return await run_choices(model, args, lambda a, ws: speculate(model, a, drafter(a), most, ws=ws))
