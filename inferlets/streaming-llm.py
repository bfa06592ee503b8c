"""streaming-llm: attention sinks plus a sliding window, so the KV memory of a generation stays flat however long
it runs (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453).

The first rows of a sequence soak up attention mass whatever they say (the "sinks"); keeping them beside a
window of the most recent rows keeps the model fluent where a plain window would not. Here:

    prefill the prompt in pieces that fill the budget (sinks + window + chunk rows), evicting between them;
    read the last piece's last row
    loop: embed the new token, read it
          if committed >= sinks + window + chunk: evict rows sinks .. committed - window - 1

The eviction waits for ``chunk`` rows (default: a page) past the budget, so that the rows after the sinks move
by whole pages: their pages are kept as they are, only the sinks' page is rebuilt, and each eviction frees
``chunk / page_size`` pages. A prompt longer than the budget streams in the same way (its first piece fills the
budget, each later one is ``chunk`` rows), so a long prompt never holds more than the budget either, and a
sliding-window model (Gemma 3's sliding layers, Mistral) stays exact: its sliding layers let go of rows that left
their window, and a prompt prefilled whole would have let go of the sinks that the compacted window attends again
(the engine refuses such an eviction). A budget within the model's window never lets a row go; a ``window`` of at
least the model's keeps the sinks out of the sliding layers' compacted window.

Kept rows keep the positions they were written at (the engine's rule: their keys are already rotated there) and
new rows continue from the sequence's logical length, so a run ends at the model's position limit as any other
does; the paper's positions counted inside the cache would need keys rotated again at every step, which the
engine does not do.

Stats: ``kv_pages`` (pages held at the end), ``kv_pages_max`` (the most held at once), ``kv_bytes`` and
``kv_bytes_max`` (the same in bytes of KV), ``evictions`` and ``evicted_rows``.
"""

from __future__ import annotations

import time

from pydantic import Field, model_validator

import inferlet
from inferlet.text import CompletionArgs, Output, StepSampler


class Args(CompletionArgs):
    sinks: int = Field(default=4, ge=0, le=1 << 16)
    window: int = Field(default=252, ge=1, le=1 << 20)
    chunk: int | None = Field(
        default=None, ge=1, le=1 << 16
    )  # rows past the budget before an eviction (default: a page)

    @model_validator(mode="after")
    def _one_choice(self) -> Args:
        if self.n != 1:
            raise ValueError("streaming-llm decodes one choice (n = 1)")
        return self


class SinkWindow:
    """Which rows to drop: everything between the sinks and the window, once ``chunk`` rows have piled up."""

    def __init__(self, sinks: int, window: int, chunk: int):
        self.sinks, self.window, self.chunk = sinks, window, chunk
        self.evictions = self.evicted_rows = 0

    async def trim(self, ws: inferlet.WorkingSet) -> None:
        if ws.committed < self.sinks + self.window + self.chunk:
            return
        stop = ws.committed - self.window
        await ws.evict(ranges=[(self.sinks, stop)])
        self.evictions += 1
        self.evicted_rows += stop - self.sinks

    async def prefill(self, ws: inferlet.WorkingSet, prompt: list[int], sampler: StepSampler, out: Output) -> None:
        """The prompt in pieces that never take the working set past the budget, trimming after each; the last
        piece picks the first token."""
        budget = self.sinks + self.window + self.chunk
        start = 0
        while len(prompt) - start > budget - ws.committed:
            stop = start + budget - ws.committed
            await inferlet.ForwardPass(ws).embed(prompt[start:stop]).submit()
            await self.trim(ws)
            start = stop
        await sampler.step(ws, prompt[start:], out)
        await self.trim(ws)


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    prompt = args.prompt_ids(model.tokenizer)
    out = Output(model.tokenizer, args, len(prompt), model.max_positions)
    sampler = StepSampler(args, prompt)
    policy = SinkWindow(args.sinks, args.window, args.chunk or model.page_size)
    ws = model.working_set()
    try:
        t0 = time.perf_counter()
        await policy.prefill(ws, prompt, sampler, out)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        t_decode = time.perf_counter()
        while not out.done:
            await sampler.step(ws, out.ids[-1:], out)
            await policy.trim(ws)
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
