"""eagle-speculative-decoding: the model's EAGLE head drafts, one fire a round.

Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"; Li et al. 2024,
"EAGLE-2"; Li et al. 2025, "EAGLE-3" (training-time test). The head is one decoder layer over the target's
last-layer features (pie_runtime/models/eagle.py); the engine keeps its K/V in the target's pages and
chains its drafts on the verify pass, so a round is one fire:

    res = fire([last, d_1..d_k], readout Eagle(k) on every row, fold=DEFERRED)
    # Eagle tokens (k+1, 1+k): column 0 is the target's argmax at the row, columns 1..k chained drafts
    # (greedy: at_accepted, so the engine chains only from the row verification stops at)
    v = verify(drafts, column 0)   (sampled: a Distribution readout too, point-mass q)
    ws.fold(1 + v.accepted);  next drafts = Eagle tokens[v.accepted, 1..k] when the emitted token is column 0

Attach a head first: ``pie drafter train --kind eagle ... --attach`` or ``pie model drafter attach MODEL
eagle:FILE``. n > 1 runs one loop per choice (inferlet.choices).
"""

from __future__ import annotations

from pydantic import Field

import inferlet
from inferlet.args import MAX_DRAFT, DecodeArgs
from inferlet.choices import run_choices
from inferlet.spec.chained import ChainedDrafter
from inferlet.spec.host_rounds import speculate


class Args(DecodeArgs):
    draft_length: int = Field(default=3, ge=0, le=MAX_DRAFT)  # at most the head's depth


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    if model.eagle_depth == 0:
        raise ValueError(
            f"model {model.name} has no EAGLE head: train one with `pie drafter train --kind eagle --corpus FILE "
            f"--attach`, or attach one with `pie model drafter attach {model.name} eagle:FILE`"
        )
    k = min(args.draft_length, model.eagle_depth)

    def drafter() -> ChainedDrafter:
        return ChainedDrafter(
            lambda d, acc: inferlet.Eagle(d, at_accepted=acc), k, model.eagle_step_ms, model.eagle_acceptance
        )

    return await run_choices(model, args, lambda a, ws: speculate(model, a, drafter(), k, ws=ws))
