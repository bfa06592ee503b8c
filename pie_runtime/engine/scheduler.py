"""Which rows run in the next step: token counts and jobs only, no tensors.

Decode-like fires (a few rows) go first so that streams keep stepping while a long prompt is prefilled in
chunks that fill the rest of the token budget. A working set's fires run in submission order: only its
oldest fire (its *head*) may run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

SHORT_FIRE_ROWS = 8
MAX_READOUT_ROWS = 1024  # readout rows of one fire, and of the fires one step finishes (bounds the lm head's logits)


class Schedulable(Protocol):
    @property
    def ws(self) -> object: ...

    @property
    def remaining(self) -> int: ...

    @property
    def readout_rows(self) -> int: ...


J = TypeVar("J", bound=Schedulable)


@dataclass
class Chunk(Generic[J]):
    job: J  # a FireJob
    rows: int


def heads(queue: Iterable[J]) -> list[J]:
    """The oldest job of each working set, in queue order."""
    seen: set[int] = set()
    out = []
    for job in queue:
        if id(job.ws) not in seen:
            seen.add(id(job.ws))
            out.append(job)
    return out


def schedule(queue: Iterable[J], max_batch_tokens: int, max_readout_rows: int = MAX_READOUT_ROWS) -> list[Chunk[J]]:
    """Chunks of the heads of ``queue`` that fill at most ``max_batch_tokens`` rows, short fires first. The fires
    the step finishes read out at most ``max_readout_rows`` rows together; a fire past that waits for the next
    step (the first chunk always runs, so every step makes progress)."""
    ready = heads(queue)
    ordered = [j for j in ready if j.remaining <= SHORT_FIRE_ROWS] + [j for j in ready if j.remaining > SHORT_FIRE_ROWS]
    chunks: list[Chunk[J]] = []
    budget, readouts = max_batch_tokens, 0
    for job in ordered:
        if budget <= 0:
            break
        rows = min(job.remaining, budget)
        if rows == job.remaining:  # the fire finishes in this step and reads out
            if chunks and readouts + job.readout_rows > max_readout_rows:
                continue
            readouts += job.readout_rows
        chunks.append(Chunk(job, rows))
        budget -= rows
    return chunks
