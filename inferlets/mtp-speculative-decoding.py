"""mtp-speculative-decoding: the model's multi-token-prediction head drafts, one fire a round.

Gloeckle et al. 2024, "Better & Faster Large Language Models via Multi-token Prediction";
DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (MTP modules used for speculative decoding).

    res = fire([last, d_1..d_k], readout MTP(k) on every row, fold=DEFERRED)
    # MTP tokens (k+1, 1+k): column 0 is the target's argmax at the row, columns 1..k chained drafts
    # (greedy: at_accepted, so the engine chains only from the row verification stops at)
    v = verify(drafts, column 0)   (sampled: a Distribution readout too, point-mass q)
    ws.fold(1 + v.accepted);  next drafts = MTP tokens[v.accepted, 1..k] when the emitted token is column 0

With --run-ahead (greedy) the loop stays in the engine: the window comes from a channel, the epilogue
verifies (n = cumprod(drafts == target[:k]).sum()), folds n + 1, writes target[0..n] to an output channel
and the next window [target[n], MTP drafts at row n] to the input (sdk/inferlet/device_rounds.py); this
inferlet only takes the output and replays the host loop's stats from it. Sampled runs use the host loop.
Run-ahead drafts --draft-length every round: the adaptive schedule (inferlet.draft_length) is host-side.
n > 1 (forks of the prompt, inferlet.choices) and ignore_eos (the engine loop stops at EOS) use the host loop.
"""

from __future__ import annotations

import inferlet
from inferlet.args import DecodeArgs
from inferlet.choices import run_choices
from inferlet.decode import speculate
from inferlet.device_rounds import mtp_run_ahead
from inferlet.drafter import Drafter, Proposal
from inferlet.sampler import Verifier


class Args(DecodeArgs):
    draft_length: int  # required: at most the model's MTP depth
    run_ahead: bool = False  # greedy: the whole loop in the engine


class MTPDrafter(Drafter):
    """Each fire's MTP readout drafts the next round. Its depth follows the draft count the planner asked
    for last (a round late: this fire's drafts are next round's), since every level of depth costs an MTP
    step and an lm head whether or not its draft is used; before a round the planner will not draft in,
    the fire reads out no MTP at all."""

    def __init__(self, k: int, step_ms: float = 0.0):
        self.k = k
        self.depth = k
        self.next: list[int] = []
        self.draft_cost_ms = step_ms

    def readouts(self, verifier: Verifier) -> list:
        if self.k == 0 or (self.planner is not None and not self.planner.will_draft()):
            return [verifier.kind()]  # the next round is a plain step: no drafts to compute for it
        if verifier.greedy:  # the engine chains drafts only from the row greedy verification stops at
            return [inferlet.MTP(self.depth, at_accepted=True)]
        return [verifier.kind(), inferlet.MTP(self.depth)]

    def observe(self, res: inferlet.PassResult, verified) -> None:
        if res.readouts[-1].kind != "mtp":
            self.next = []
            return
        tokens = res.readouts[-1].tokens[verified.accepted]  # (1+depth,) at the last accepted row
        # the chained drafts follow column 0; a sampled token that differs from it leaves none
        drafts = [int(t) for t in tokens[1:]]
        self.next = drafts if int(tokens[0]) == verified.tokens[-1] and min(drafts, default=0) >= 0 else []

    async def propose(self, seq: list[int], k: int) -> Proposal:
        if self.k:
            self.depth = min(max(k, 1), self.k)
        return Proposal(self.next[:k])


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    model.require_mtp(args.draft_length)
    if args.run_ahead and args.n == 1 and not args.ignore_eos:
        return await mtp_run_ahead(model, args, MTPDrafter(args.draft_length), args.draft_length)
    return await run_choices(
        model,
        args,
        lambda a, ws: speculate(model, a, MTPDrafter(a.draft_length, model.mtp_step_ms), a.draft_length, ws=ws),
    )
