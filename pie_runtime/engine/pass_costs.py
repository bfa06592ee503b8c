"""The cost of one sequence's pass by its row count, measured at engine start and published in ``hello``.

A speculative inferlet picks how many drafts to verify from what a wider window costs on *this* engine: the curve's
shape differs by device and format (on a CPU a few rows cost about one, in bfloat16 more rows do, on a GPU wider
still is nearly free; docs/performance.md, "Pass costs"). Guessing that curve in the SDK would be wrong somewhere,
so the engine times it: a pass of w rows after ``context`` cached tokens plus the lm head and argmax of every row
(what a greedy verify fire runs), the median of a few repeats taken round-robin over the widths, for w = 1..6 and a
few wider windows up to ``max_rows``, made non-decreasing and interpolated between them.

It runs before the engine serves anyone, on the first pages of the KV pool, which hold nothing yet; the
K/V it writes there is garbage that the next owner of those pages overwrites.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from ..models.context import Segment
from .runner import ModelRunner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_widths(max_rows: int) -> list[int]:
    """Every width up to 6, then doubling steps: the curve bends where the kernels change, mostly below 6."""
    return sorted({w for w in [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, max_rows] if w <= max_rows})


def measure_pass_costs(
    runner: ModelRunner, num_pages: int, max_rows: int, context: int = 128, repeats: int = 3
) -> list[float]:
    """[cost of a 1-row pass, ..., of a max_rows-row pass] in milliseconds; [] when the pool is too small.
    ``context`` shrinks to what the pool holds."""
    widths = measured_widths(max_rows)
    costs = time_passes(runner, num_pages, widths, repeats, context)
    if not costs:
        return []
    dense = np.interp(np.arange(1, max_rows + 1), widths, isotonic(costs))
    return [round(float(c), 3) for c in dense]


def time_passes(
    runner: ModelRunner, num_pages: int, widths: list[int], repeats: int, context: int = 128
) -> list[float]:
    """The median ms of a pass of each of ``widths`` rows after ``context`` cached tokens; [] when the pool is
    too small."""
    ps = runner.kv.page_size
    widest = max(widths, default=0)
    context = min(context, num_pages * ps - widest)
    if widest < 1 or context < 1:
        return []
    one_pass = _pass_on(runner, context + widest)
    one_pass(0, context, readout=False)  # the cached context the windows attend to (its logits: not timed, and
    # at a 262k vocabulary a 128-row readout alone would be the engine's largest transient)
    for rows in widths:
        one_pass(context, rows)  # warm-up: first calls at a new shape pick their kernels
    # round-robin over the widths, so a slow spell of the machine spreads over all of them
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(repeats):
        for rows in widths:
            _sync(runner.device)
            t0 = time.perf_counter()
            one_pass(context, rows)
            _sync(runner.device)
            times[rows].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(times[w]) for w in widths]


def _pass_on(runner: ModelRunner, rows: int) -> Callable[..., None]:
    """A function running one sequence's pass of ``rows`` rows from sequence index ``start`` on the pool's first
    pages (lm head and argmax included unless ``readout=False``), for ``rows`` up to the given count."""
    ps = runner.kv.page_size
    table = list(range((rows + ps - 1) // ps))
    more = (table,) * (runner.kv.layout.groups - 1)  # every page group on the same pages: timing, not content
    vocab = runner.vocab

    def one_pass(start: int, rows: int, readout: bool = True) -> None:
        tokens = [(i * 7919) % vocab for i in range(rows)]
        hidden = runner.forward(
            [Segment(table, start, rows, group_tables=more)], tokens, list(range(start, start + rows))
        )
        if not readout:
            return
        with torch.inference_mode():
            runner.model.logits(hidden).argmax(-1)

    return one_pass


def warm_up(runner: ModelRunner, num_pages: int) -> None:
    """Passes of the shapes a step runs (a prefill chunk, one row, a verify window), so that a compiled
    model compiles its graphs now and not in a client's first step."""
    rows = min(64, num_pages * runner.kv.page_size)
    one_pass = _pass_on(runner, rows)
    for start, n in ((0, rows // 2), (rows // 2, 1), (rows // 2, 5), (rows // 2 + 5, 2)):
        if start + n <= rows:
            one_pass(start, n)


def isotonic(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators): a wider pass is not cheaper, and a noisy
    dip or spike at one width would otherwise decide a planner's choice."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def measure_mtp_step_ms(runner: ModelRunner, repeats: int = 5) -> float:
    """ms of one more MTP draft on a row (one MTP module step and the lm head); 0.0 without an MTP head."""
    if runner.mtp is None:
        return 0.0
    hidden = torch.zeros(
        1, runner.model.config.hidden_size, dtype=next(runner.model.parameters()).dtype, device=runner.device
    )
    first = torch.zeros(1, dtype=torch.int64, device=runner.device)
    runner.mtp.draft(hidden, first, 1, with_logits=False)  # warm-up: a greedy readout's step, the usual one
    times = []
    for _ in range(repeats):
        _sync(runner.device)
        t0 = time.perf_counter()
        runner.mtp.draft(hidden, first, 1, with_logits=False)
        _sync(runner.device)
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def measure_eagle_step_ms(runner: ModelRunner, kv_pages: int, context: int = 256, repeats: int = 5) -> float:
    """ms of one more EAGLE draft on a row over a ``context``-row sequence (one draft layer step over the
    pool layer's K/V and the lm head); 0.0 without an EAGLE head."""
    if runner.eagle is None:
        return 0.0
    ps = runner.kv.page_size
    pages = list(range(min(kv_pages, (context + ps - 1) // ps)))
    dtype = next(runner.model.parameters()).dtype
    feature = torch.ones(1, runner.model.config.hidden_size, dtype=dtype, device=runner.device)
    first = torch.zeros(1, dtype=torch.int64, device=runner.device)
    index = torch.tensor([len(pages) * ps - 1], device=runner.device)

    def one() -> None:
        assert runner.eagle is not None
        runner.eagle.draft(feature, first, index, pages, runner.kv, 2, with_logits=False)

    one()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(runner.device)
        t0 = time.perf_counter()
        one()
        _sync(runner.device)
        times.append((time.perf_counter() - t0) * 1e3 / 2)
    return round(statistics.median(times), 3)
