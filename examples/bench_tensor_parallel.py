"""Tensor parallelism against one rank on the same model: greedy tokens and float32 logits over 64 steps,
and the engine's measured pass cost (``hello``'s pass-cost curve, ms by rows), for

- T=1 with 2 threads (all the cores in one rank), T=1 with 1 thread, and T=2 with 1 thread a rank.

    python examples/bench_tensor_parallel.py [--model NAME] [--steps 64] [--ranks 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import inferlet
from pie_runtime.launcher import EmbeddedEngine
from pie_runtime.shipped import ensure_default_model
from pie_runtime.store import DEFAULT_MODEL

PROMPT = "The history of the printing press begins"


async def greedy(address: str, model_name: str, steps: int) -> tuple[list[int], np.ndarray, list[float]]:
    session = await inferlet.connect(address)
    try:
        model = inferlet.model(model_name)
        ws = model.working_set()
        window, tokens, rows = model.tokenizer.encode(PROMPT), [], []
        for _ in range(steps):
            fp = inferlet.ForwardPass(ws)
            fp.embed(window).readout([len(window) - 1], inferlet.Logits())
            logits = (await fp.submit()).logits
            assert logits is not None
            rows.append(logits[0])
            tokens.append(int(np.argmax(logits[0])))
            window = [tokens[-1]]
        await ws.release()
        return tokens, np.stack(rows), list(model.info.pass_cost_ms)
    finally:
        session.client.close()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--ranks", type=int, default=2)
    a = p.parse_args()
    if a.model == DEFAULT_MODEL:
        ensure_default_model()
    setups = [("T=1, 2 threads", 1, 2), ("T=1, 1 thread", 1, 1), (f"T={a.ranks}, 1 thread a rank", a.ranks, 1)]
    rows = []
    for label, ranks, threads in setups:
        words = ["--weights", "fp32", "--no-compile", "--kv-pages", "64", "--threads", str(threads)]
        words += ["--pass-cost-rows", "16", "--tensor-parallel", str(ranks)]
        with EmbeddedEngine([a.model], words) as engine:
            rows.append((label, *await greedy(engine.address, a.model, a.steps)))
    ref_tokens, ref_logits = rows[0][1], rows[0][2]
    print(f"\n{a.model}, fp32, {a.steps} greedy steps; pass cost in ms by rows (the engine's own measurement)")
    print(f"{'setup':<26}{'1 row':>8}{'4 rows':>8}{'16 rows':>9}{'tokens = T=1':>14}{'max |dlogit|':>14}")
    for label, tokens, logits, cost in rows:
        same = "yes" if tokens == ref_tokens else f"no ({sum(x == y for x, y in zip(tokens, ref_tokens))})"
        diff = float(np.abs(logits - ref_logits).max())
        print(f"{label:<26}{cost[0]:>8.1f}{cost[3]:>8.1f}{cost[15]:>9.1f}{same:>14}{diff:>14.2e}")


if __name__ == "__main__":
    asyncio.run(main())
