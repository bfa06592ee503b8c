"""The one round loop of the speculative inferlets: a run's state and result (``Run``), what a way of producing
rounds plugs into it (``Rounds``) and the loop itself (``drive``), which keeps the run's timing once for all of
them:

    prefill_ms   window = rounds.prefill()                    # the prompt's pass, and its first token(s)
    decode_s     loop: output.push(tokens) → rounds.taken(kept) → until done: tokens = rounds.next()
                 rounds.end()                                 # then the working set is released
    round_ms     each round's pass, submitted through ``Run.fire``

Three ways plug in: host-verified rounds (inferlet.spec.host_rounds: the drafter proposes, the host verifies),
device-verified rounds (inferlet.spec.device_rounds.verify_rounds: the same drafting, an epilogue verifies and
folds) and run-ahead rounds (device_rounds.mtp_run_ahead: the engine runs the rounds, the host replays them);
the first two share their drafting (inferlet.spec.drafting).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ..forward import ForwardPass, PassResult
from ..model import Model
from ..runtime import inferlet_name
from ..text.arguments import DecodeArgs
from ..text.output import Output
from ..working_set import WorkingSet
from .stats import SpecStats


@dataclass
class Run:
    """The state of one speculative run, and the result it builds."""

    model: Model
    args: DecodeArgs
    prompt: list[int]
    out: Output
    ws: WorkingSet
    stats: SpecStats = field(default_factory=SpecStats)
    prefill_ms: float = 0.0
    decode_s: float = 0.0
    round_ms: list[float] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)
    overhead_ms: float | None = None  # the policy's last estimate of a round's overhead (adaptive schedule)
    plain_overhead_ms: float | None = None  # ... and of a plain round's, once one was timed
    logprobs: list[dict] | None = None

    @classmethod
    def start(cls, model: Model, args: DecodeArgs, ws: WorkingSet | None = None) -> Run:
        """A run of ``args``: its prompt tokenized, an empty Output cut at the model's capacity, and ``ws`` or a
        new working set (opened in the engine by the prefill)."""
        prompt = args.prompt_ids(model.tokenizer)
        out = Output(model.tokenizer, args, len(prompt), model.max_positions)
        return cls(model, args, prompt, out, ws if ws is not None else model.working_set())

    async def fire(self, fp: ForwardPass) -> PassResult:
        """Submits one round's pass, timing it in ``round_ms``."""
        t0 = time.perf_counter()
        res = await fp.submit()
        self.round_ms.append((time.perf_counter() - t0) * 1e3)
        return res

    async def finish(self) -> dict:
        """Reports the run's counters to the engine (summed in its ``stats``), then returns the result."""
        self.stats.replayed_rows = self.ws.replayed_rows
        await self.model.client.request(
            "spec_report",
            model=self.model.name,
            inferlet=inferlet_name(),
            **asdict(self.stats),
            decode_tokens=max(len(self.out.ids) - 1, 0),
            decode_s=self.decode_s,
            prefill_ms=self.prefill_ms,
        )
        return self.result()

    def result(self) -> dict:
        decoded = max(len(self.out.ids) - 1, 0)  # the first token came with the prefill
        rate = round(decoded / self.decode_s, 2) if self.decode_s > 0 and decoded else 0.0
        stats = {
            "prompt_tokens": len(self.prompt),
            "generated_tokens": len(self.out.ids),
            "cached_tokens": min(self.ws.cached_rows, len(self.prompt)),
            "kv_pages": self.ws.pages,  # KV pages held at the end (the last fire's), and the most held at once
            "kv_pages_max": self.ws.pages_max,
            "kv_bytes": self.ws.kv_bytes,  # bytes of KV held at the end, and the most held at once
            "kv_bytes_max": self.ws.kv_bytes_max,
            **self.stats.as_dict(rate, round(self.prefill_ms, 2)),
        }
        if self.args.timing:
            stats["round_ms"] = [round(t, 3) for t in self.round_ms]
            stats["draft_ms"] = [round(t, 3) for t in self.draft_ms]
            if self.overhead_ms is not None:
                stats["overhead_ms"] = round(self.overhead_ms, 3)
            if self.plain_overhead_ms is not None:
                stats["plain_overhead_ms"] = round(self.plain_overhead_ms, 3)
        res = {**self.out.result(), "stats": stats, "speculation": self.stats.summary()}
        if self.logprobs is not None:
            res["logprobs"] = self.logprobs
        return res


class Rounds:
    """One way of producing a run's tokens round by round, driven by ``drive``."""

    async def prefill(self) -> list[int]:
        """The prompt's pass (of the rows the working set lacks); returns the tokens it emits."""
        raise NotImplementedError

    async def taken(self, tokens: list[int]) -> None:
        """The tokens of the last round (or the prefill) the output kept."""

    async def next(self) -> list[int] | None:
        """One round; returns the tokens it emits, None when no round can follow (the output stays as it is)."""
        raise NotImplementedError

    async def end(self) -> None:
        """After the last round, timed with the decode (a run-ahead is stopped here)."""

    async def close(self) -> None:
        """Releases what the rounds hold, whether the loop ended or failed."""


async def drive(run: Run, rounds: Rounds) -> None:
    """The round loop (module docstring): prefill, then rounds until the output is done; records the prefill's
    ms and the decode's s, and releases the rounds and the working set at the end."""
    out = run.out
    try:
        t0 = time.perf_counter()
        new: list[int] | None = await rounds.prefill()
        run.prefill_ms = (time.perf_counter() - t0) * 1e3
        run.round_ms.clear()
        t_decode = time.perf_counter()
        while new is not None:
            await rounds.taken(new[: out.push(new)])
            if out.done:
                break
            new = await rounds.next()
        await rounds.end()
        run.decode_s = time.perf_counter() - t_decode
    finally:
        await rounds.close()
        await run.ws.release()
