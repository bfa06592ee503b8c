"""h2o: keep a budget of KV rows, the most recent ones and the "heavy hitters" that gathered the most attention so
far, and evict the rest, so the KV memory of a generation stays bounded (Zhang et al. 2023, "H2O: Heavy-Hitter
Oracle for Efficient Generative Inference of Large Language Models", NeurIPS 2023, arXiv:2306.14048).

A few rows draw most of the attention mass; the paper keeps them (ranked by the mass they accumulated over every
query so far) beside a recent window. Every fire reads the attention readout (``inferlet.AttentionScores``: the
softmax mass each row received, summed over heads and layers) at its rows:

    score[row] += the mass each fired row gave it
    if committed >= budget + chunk:
        keep the last `recent` rows and the budget - recent other rows of highest score (ties: earlier rows)
        evict the others (their scores go with them)

The eviction waits for ``chunk`` rows (default: a page) past the budget, so that one eviction frees a page or
more; a prompt is fired ``prefill_chunk`` rows at a time (each reading its rows' mass), evicting between chunks.
Kept rows keep their positions (the engine's rule), so new rows continue from the sequence's logical length.
With a budget above the sequence's length nothing is evicted and the tokens are text-completion's.

    pie run h2o -- --budget 256 [--recent 128] --prompt "..." --max-tokens 1000

Stats: ``kv_pages`` (pages held at the end), ``kv_pages_max`` (the most held at once), ``kv_bytes`` and
``kv_bytes_max`` (the same in bytes of KV), ``kv_rows``, ``evictions`` and ``evicted_rows``.
"""

from __future__ import annotations

import time

import numpy as np
from pydantic import Field, model_validator

import inferlet
from inferlet.text import CompletionArgs, Output, StepSampler


class Args(CompletionArgs):
    budget: int = Field(default=256, ge=2, le=1 << 20)  # rows kept after an eviction
    recent: int | None = Field(default=None, ge=1, le=1 << 20)  # of them, the most recent (default: half the budget)
    chunk: int | None = Field(
        default=None, ge=1, le=1 << 16
    )  # rows past the budget before an eviction (default: a page)
    prefill_chunk: int = Field(default=64, ge=1, le=1024)  # prompt rows a fire, each reading its attention mass

    @model_validator(mode="after")
    def _fits(self) -> Args:
        if self.n != 1:
            raise ValueError("h2o decodes one choice (n = 1)")
        if self.recent is not None and self.recent > self.budget:
            raise ValueError(f"recent {self.recent} exceeds the budget {self.budget}")
        return self


class HeavyHitters:
    """H2O's rule over one working set: each row's accumulated attention mass, and which rows an eviction keeps."""

    def __init__(self, budget: int, recent: int, chunk: int):
        self.budget, self.recent, self.chunk = budget, recent, chunk
        self.score = np.zeros(0, dtype=np.float64)  # one entry per committed row of the working set
        self.evictions = self.evicted_rows = 0

    def observe(self, mass: np.ndarray) -> None:
        """Adds an AttentionScores readout's (rows, keys) mass; keys are the working set's rows."""
        width = mass.shape[-1]
        if width > len(self.score):
            self.score = np.concatenate([self.score, np.zeros(width - len(self.score))])
        self.score[:width] += mass.reshape(-1, width).sum(0, dtype=np.float64)

    def keep(self, committed: int) -> np.ndarray:
        """The rows to keep of ``committed``, ascending: the ``recent`` last, then the highest scores."""
        older = committed - self.recent
        heavy = np.argsort(-self.score[:older], kind="stable")[: self.budget - self.recent]
        return np.concatenate([np.sort(heavy), np.arange(older, committed)])

    async def trim(self, ws: inferlet.WorkingSet) -> None:
        if ws.committed < self.budget + self.chunk:
            return
        kept = self.keep(ws.committed)
        dropped = np.setdiff1d(np.arange(ws.committed), kept)
        await ws.evict(ranges=_runs(dropped))
        self.score = self.score[kept]
        self.evictions += 1
        self.evicted_rows += len(dropped)

    async def fire(self, ws: inferlet.WorkingSet, window: list[int], fp: inferlet.ForwardPass) -> inferlet.PassResult:
        """Submits ``fp`` (``window`` embedded, its other readouts chosen) with the attention readout on every row
        of the window, notes the mass and trims. The attention readout is the pass's last."""
        res = await fp.readout(range(len(window)), inferlet.AttentionScores()).submit()
        scores = res.readouts[-1].scores
        assert scores is not None
        self.observe(scores)
        await self.trim(ws)
        return res


def window_conflict(
    windows: list[int | None], rows: int, budget: int, recent: int, chunk: int, prefill_chunk: int
) -> str | None:
    """Why a run of ``rows`` rows could be refused on a sliding-window model (``windows``: the model's page
    groups' windows), else None. Its sliding layers let go of rows that left their window, and after an eviction
    the window counts rows of the compacted set: once the working set has passed the window, an eviction whose
    last W - 1 kept rows are not all recent ones would bring a heavy hitter the layers let go of back into it
    (the engine refuses it, ``unsupported``). Below the window nothing is let go; recent >= W - 1 keeps it recent."""
    sliding = [w for w in windows if w is not None]
    if not sliding or rows < budget + chunk:
        return None
    w = min(sliding)
    if min(rows, budget + chunk - 1 + prefill_chunk) <= w or recent >= w - 1:
        return None
    return (
        f"h2o: the model's sliding layers hold only their last {w} rows, and a budget of {budget} (plus a chunk "
        f"of {chunk} and a prefill chunk of {prefill_chunk}) passes them with only {recent} recent rows: an "
        f"eviction would bring rows they let go of back into their window; give --recent {w - 1} or more, a "
        f"budget of at most {w - chunk - prefill_chunk + 1}, or serve the model with --kv-swa-full"
    )


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """Ascending row indices as [start, stop) ranges of consecutive rows."""
    if not len(rows):
        return []
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(rows, cuts)]


async def prefill(
    ws: inferlet.WorkingSet, prompt: list[int], step: int, policy: HeavyHitters, sampler: StepSampler, out: Output
) -> None:
    """The prompt, ``step`` rows a fire (each reading its rows' mass, trimming between); the last picks a token."""
    chunks = [prompt[i : i + step] for i in range(0, len(prompt), step)]
    for window in chunks[:-1]:
        await policy.fire(ws, window, inferlet.ForwardPass(ws).embed(window))
    await sampler.step(ws, chunks[-1], out, policy.fire)


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    prompt = args.prompt_ids(model.tokenizer)
    out = Output(model.tokenizer, args, len(prompt), model.max_positions)
    sampler = StepSampler(args, prompt)
    recent = args.recent if args.recent is not None else max(args.budget // 2, 1)
    chunk = args.chunk or model.page_size
    conflict = window_conflict(
        model.info.page_windows, len(prompt) + args.max_tokens, args.budget, recent, chunk, args.prefill_chunk
    )
    if conflict:
        raise ValueError(conflict)
    policy = HeavyHitters(args.budget, recent, chunk)
    ws = model.working_set()
    try:
        t0 = time.perf_counter()
        await prefill(ws, prompt, args.prefill_chunk, policy, sampler, out)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        t_decode = time.perf_counter()
        while not out.done:
            await sampler.step(ws, out.ids[-1:], out, policy.fire)
        decode_s = time.perf_counter() - t_decode
    finally:
        await ws.release()
    return sampler.result(
        out,
        ws,
        len(prompt),
        decode_s,
        prefill_ms=round(prefill_ms, 2),
        kv_rows=ws.committed,
        evictions=policy.evictions,
        evicted_rows=policy.evicted_rows,
    )
