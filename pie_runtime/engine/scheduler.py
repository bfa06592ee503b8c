"""Which rows run in the next step: token counts and jobs only, no tensors.

Decode-like fires (a few rows) go first so that streams keep stepping while a long prompt is prefilled in
chunks that fill the rest of the token budget. A working set's fires run in submission order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SHORT_FIRE_ROWS = 8


@dataclass
class Chunk:
    job: Any  # a FireJob: anything with .ws and .remaining
    rows: int


def schedule(queue: list, max_batch_tokens: int) -> list[Chunk]:
    heads, seen = [], set()
    for job in queue:
        if id(job.ws) not in seen:  # only the oldest fire of each working set may run
            seen.add(id(job.ws))
            heads.append(job)
    ordered = [j for j in heads if j.remaining <= SHORT_FIRE_ROWS] + [j for j in heads if j.remaining > SHORT_FIRE_ROWS]
    chunks: list[Chunk] = []
    budget = max_batch_tokens
    for job in ordered:
        if budget <= 0:
            break
        rows = min(job.remaining, budget)
        chunks.append(Chunk(job, rows))
        budget -= rows
    return chunks
