"""mtp-speculative-decoding: the model's multi-token-prediction head drafts, one fire a round.

Gloeckle et al. 2024, "Better & Faster Large Language Models via Multi-token Prediction";
DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (MTP modules used for speculative decoding).

    res = fire([last, d_1..d_k], readout MTP(k) on every row, fold=DEFERRED)
    # MTP tokens (k+1, 1+k): column 0 is the target's argmax at the row, columns 1..k chained drafts
    v = verify(drafts, column 0)   (sampled: a Distribution readout too, point-mass q)
    ws.fold(1 + v.accepted);  next drafts = MTP tokens[v.accepted, 1..k] when the emitted token is column 0
"""

from __future__ import annotations

import inferlet
from inferlet.decode import DecodeArgs, Drafter, Proposal, Verifier, speculate


class Args(DecodeArgs):
    draft_length: int  # required: at most the model's MTP depth


class MTPDrafter(Drafter):
    def __init__(self, k: int):
        self.k = k
        self.next: list[int] = []

    def readouts(self, verifier: Verifier) -> list:
        if self.k == 0:
            return [verifier.kind()]
        mtp = inferlet.MTP(self.k)
        return [mtp] if verifier.greedy else [verifier.kind(), mtp]

    def observe(self, res: inferlet.PassResult, verified) -> None:
        if self.k == 0:
            return
        tokens = res.readouts[-1].tokens[verified.accepted]  # (1+k,) at the last accepted row
        # the chained drafts follow column 0; a sampled token that differs from it leaves none
        self.next = [int(t) for t in tokens[1:]] if int(tokens[0]) == verified.tokens[-1] else []

    async def propose(self, seq: list[int], k: int) -> Proposal:
        return Proposal(self.next[:k])


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    if args.draft_length > model.mtp_depth:
        raise ValueError(f"--draft-length {args.draft_length} past the model's MTP depth {model.mtp_depth}")
    return await speculate(model, args, MTPDrafter(args.draft_length), args.draft_length)
