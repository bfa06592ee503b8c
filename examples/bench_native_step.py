"""The native step's cost by rows, in process CPU time: one sequence's pass of 1/2/4/8/16 rows after a cached
context (a verify window's width, lm head and argmax included), the widths round-robin and the median of the
repeats, then a prefill pass; with ``--stages`` the decoder's stages (a library built with per-stage timers).

    .venv/bin/python examples/bench_native_step.py [--weights int4] [--context 128] [--threads 1] [--stages]

With one thread, process CPU time counts this process's work only, so the figures hold on a machine other
processes share (memory bandwidth is still shared: a 1-row pass, which streams the weights, moves the most).
With more threads it counts every thread's time: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="int4", choices=["int4", "int8"])
    p.add_argument("--context", type=int, default=128, help="cached tokens before each timed pass (default 128)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--prefill", type=int, default=512, help="rows of the timed prefill pass (0: none)")
    p.add_argument("--stages", action="store_true", help="time the decoder's stages (builds a profiling library)")
    a = p.parse_args()
    if a.stages:
        os.environ["PIE_NATIVE_PROFILE"] = "1"  # read when the library is built: before anything loads it

    import torch
    from rich.console import Console
    from rich.table import Table

    from pie_runtime.engine.build import build_served_model
    from pie_runtime.engine.options import ServeOptions
    from pie_runtime.engine.pass_costs import _pass_on
    from pie_runtime.models import native_lib

    torch.set_num_threads(a.threads)
    widths = [1, 2, 4, 8, 16]
    pages = (a.context + max(widths + [a.prefill]) + 15) // 16 + 1
    served = build_served_model(a.model, ServeOptions(weights=a.weights, kv_pages=pages))
    one = _pass_on(served.runner, pages * 16)
    one(0, a.context)
    for w in widths:
        one(a.context, w)  # warm-up
    times: dict[int, list[float]] = {w: [] for w in widths}
    stages: dict[int, dict[str, float]] = {}
    for _ in range(a.repeats):
        for w in widths:
            native_lib.stage_times(reset=True)
            t0 = time.process_time()
            one(a.context, w)
            times[w].append((time.process_time() - t0) * 1e3)
            for k, v in native_lib.stage_times(reset=True).items():
                stages.setdefault(w, {}).setdefault(k, 0.0)
                stages[w][k] += v * 1e3 / a.repeats
    med = {w: statistics.median(v) for w, v in times.items()}
    kernels = native_lib.variant() or f"torch ({native_lib.unavailable_reason()})"
    t = Table(title=f"{a.model} {a.weights}, {kernels}, {a.threads} thread(s), {a.context} cached tokens")
    for col in ("rows", "pass ms (CPU)", "vs 1 row", *([k for k in stages.get(1, {})] if stages else [])):
        t.add_column(col, justify="right")
    for w in widths:
        st = [f"{stages[w][k]:.2f}" for k in stages.get(1, {})] if stages else []
        t.add_row(str(w), f"{med[w]:.2f}", f"{med[w] / med[1]:.2f}x", *st)
    Console(width=200).print(t)
    if a.prefill:
        t0 = time.process_time()
        one(0, a.prefill)
        s = time.process_time() - t0
        print(f"prefill of {a.prefill} rows: {s * 1e3:.0f} ms CPU, {a.prefill / s:.0f} tokens/s of CPU time")


if __name__ == "__main__":
    main()
