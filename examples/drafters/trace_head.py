"""An inferlet that records what the model's MTP head would draft at every step of a greedy decode, for
replaying draft-length planners offline (examples/drafters/replay_planner.py).

Each step fires the last token with a head readout of depth ``--depth`` on its row: column 0 is the target's
greedy token, columns 1.. the head's chained drafts for the tokens after it, exactly what a speculative
round starting at that row would verify (greedy output does not depend on the window around it). Returns the
rows, the engine's pass-cost curve, the head's step cost and each step's wall time.

    pie run examples/drafters/trace_head.py --json -- --prompt "..." --max-tokens 128 --depth 3
"""

from __future__ import annotations

import time

import inferlet
from inferlet.text import CompletionArgs


class Args(CompletionArgs):
    depth: int = 3


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    model.require_mtp(args.depth)
    readout = inferlet.MTP(args.depth)
    ws = model.working_set()
    window = args.prompt_ids(model.tokenizer)
    rows: list[list[int]] = []
    wall_ms: list[float] = []
    try:
        while len(rows) < args.max_tokens:
            t0 = time.perf_counter()
            fp = inferlet.ForwardPass(ws).embed(window).readout([len(window) - 1], readout).fold(len(window))
            res = await fp.submit()
            if rows:  # the prefill is not a step
                wall_ms.append((time.perf_counter() - t0) * 1e3)
            tokens = res.readouts[0].tokens
            assert tokens is not None
            rows.append([int(t) for t in tokens[0]])
            if rows[-1][0] in model.eos_token_ids:
                break
            window = rows[-1][:1]
    finally:
        await ws.release()
    return {
        "rows": rows,
        "pass_cost_ms": model.pass_cost_ms,
        "step_ms": model.mtp_step_ms,
        "wall_ms": wall_ms,
        "acceptance": model.mtp_acceptance,
    }
