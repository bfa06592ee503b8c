"""A decode loop left with the engine (``ForwardPass.run_ahead``), from the inferlet's side:

    prefill     fire(prompt), epilogue `first`: writes the first window to `inp`, the first output cell to `out`
    run-ahead   fire(window from `inp`), epilogue `step`: picks (and folds) the step's tokens, writes the next
                window to `inp` and an output cell to `out`; the engine re-fires it with no round trip until
                its token budget, an EOS in `out`, the model's capacity, or a nonzero `flag`
    host        takes the first cell, then drains `out` (TAKE_AT_LEAST cells a reply while the run is ahead)
                into an Output; sets `flag` when the Output ends first (a stop string), closes the channels

text-completion --run-ahead picks one token a step; the MTP run-ahead (inferlet.spec.device_rounds) verifies a
window of drafts a step and writes its accepted tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pie_runtime.protocol import ErrorCode, PieError

from ..channels import Channel
from ..forward import ForwardPass, PassResult
from ..programs import Builder, trace
from ..text.output import Output
from ..working_set import WorkingSet

TAKE_AT_LEAST = 8  # output cells a take waits for while the run is ahead: fewer replies, less host work a token
OUTPUT_CELLS = 256  # the output channel's capacity: how far the run may get ahead of the host


class RunAhead:
    """The channels of one run-ahead on a working set, and the in-flight run once launched."""

    def __init__(self, ws: WorkingSet, inp: Channel, out: Channel, flag: Channel):
        self.ws, self.inp, self.out, self.flag = ws, inp, out, flag
        self.channels = [inp, out, flag]  # closed by ``close``
        self.task: asyncio.Task[PassResult] | None = None

    @classmethod
    async def open(cls, ws: WorkingSet, width: int) -> RunAhead:
        """Opens the input channel (one window of ``width`` tokens), the output channel (cells of ``width``)
        and the stop flag."""
        model = ws.model
        inp = await Channel.open(model, (width,), "int32", 1)
        out = await Channel.open(model, (width,), "int32", OUTPUT_CELLS)
        flag = await Channel.open(model, (), "int32", 1)
        return cls(ws, inp, out, flag)

    async def open_channel(self, shape: tuple[int, ...], dtype: str, capacity: int = 1) -> Channel:
        """One more channel the run's programs use (a sampler's rng state), closed with the others."""
        ch = await Channel.open(self.ws.model, shape, dtype, capacity)
        self.channels.append(ch)
        return ch

    async def launch(
        self, prompt: list[int], first: Callable[[Builder], None], step: Callable[[Builder], None], budget_tokens: int
    ) -> None:
        """Sends the prefill (its epilogue traced from ``first``) and, when ``budget_tokens`` > 0, the run-ahead
        (from ``step``), which stops after that many tokens or at the model's EOS."""
        model = self.ws.model
        await ForwardPass(self.ws).embed(prompt).epilogue(trace(model, first)).launch()
        if budget_tokens > 0:
            fp = ForwardPass(self.ws).embed_from(self.inp).epilogue(trace(model, step))
            fp.run_ahead(
                self.out, budget_tokens=budget_tokens, stop_tokens=model.tokenizer.eos_token_ids, stop_channel=self.flag
            )
            self.task = await fp.launch()

    async def first(self) -> list[int]:
        """The prefill's output cell."""
        return (await self.out.take(max=1)).tolist()[0]

    async def cells(self) -> list[list[int]]:
        """The next output cells (at least TAKE_AT_LEAST while the run is ahead); [] once the run has ended (its
        budget, an EOS, or capacity) and every cell is taken, or when none was launched."""
        if self.task is None:
            return []
        try:
            return (await self.out.take(max=OUTPUT_CELLS, min=TAKE_AT_LEAST)).tolist()
        except PieError as e:
            if e.code != ErrorCode.CHANNEL_EMPTY:
                raise
            return []

    async def drain(self, output: Output, tokens: Callable[[list[int]], list[int]] = lambda cell: cell) -> None:
        """Pushes ``tokens(cell)`` of each output cell into ``output`` until it is done, or the run has ended
        and every cell is taken."""
        while not output.done:
            batch = await self.cells()
            if not batch:
                return
            for cell in batch:
                output.push(tokens(cell))
                if output.done:
                    return

    async def stop(self) -> str | None:
        """Stops the run if it still runs and waits for its answer; returns why it ended ("budget_tokens",
        "stop_token", "stop_channel", "capacity", ...), None when none was launched."""
        if self.task is None:
            return None
        if not self.task.done():
            await self.flag.set(1)
        summary = (await self.task).run
        assert summary is not None, "a run-ahead answers with its summary"
        return summary["reason"]

    async def close(self) -> None:
        """Stops the run if it still runs (whatever its answer) and closes the channels."""
        if self.task is not None and not self.task.done():
            await self.flag.set(1)
            await asyncio.gather(self.task, return_exceptions=True)
        for ch in self.channels:
            await ch.close()
