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
and the next window [target[n], MTP drafts at row n] to the input (sdk/inferlet/device_rounds.py); this
inferlet only takes the output and replays the host loop's stats from it. Sampled runs use the host loop.
Run-ahead drafts --draft-length every round: the adaptive schedule (inferlet.draft_length) is host-side.
n > 1 (forks of the prompt, inferlet.choices) and ignore_eos (the engine loop stops at EOS) use the host loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field

import inferlet
from inferlet.spec import (
    Drafter,
    NgramIndex,
    Proposal,
    TokenTree,
    TreeVerdict,
    Verifier,
    VerifyResult,
    mtp_run_ahead,
    next_depth,
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


class MTPDrafter(Drafter):
    """Each fire's MTP readout drafts the next round. Its depth is the planner's, weighed over this round's
    possible verdicts (``next_depth``), since every level of depth costs an MTP step and an lm head whether or
    not its draft is used; before a round the planner will not draft in, the fire reads out no MTP at all."""

    def __init__(
        self,
        k: int,
        step_ms: float = 0.0,
        widths: list[int] | None = None,
        lookup: int = 0,
        acceptance: Sequence[float] = (),
    ):
        self.k = k
        # with --lookup: the text so far, n-gram indexed, and the longest lookup draft
        self.index = NgramIndex(LOOKUP_NGRAM[1], LOOKUP_NGRAM[0]) if lookup else None
        self.lookup = lookup
        self.proposed = 0  # chain drafts the fire being built verifies
        self.next: list[int] = []
        self.next_tree: TokenTree | None = None
        # a lookup draft costs nothing; the head's chain, run every fire, is then the round's overhead
        self.draft_cost_ms = 0.0 if lookup else step_ms
        # the head's training record (Model.mtp_acceptance) as the planner's prior, unless lookups share the rounds
        self.acceptance_prior = () if lookup else acceptance
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
