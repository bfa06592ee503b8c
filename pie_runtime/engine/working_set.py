"""A working set: one sequence's page table and committed length, with the fold rule of DESIGN.md §3.

Rows ``0 .. committed-1`` are frozen. A fire writes rows ``committed ..`` unfrozen; its fold moves
``committed`` forward by the fold count, and the rows past it are overwritten by the next fire.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkingSet:
    id: int
    owner: bytes  # the client identity that opened it
    model: str
    pages: list[int] = field(default_factory=list)
    committed: int = 0
    pending_fold: int | None = None  # window size of a fire whose fold is deferred and not yet settled
    in_flight: int = 0  # fires accepted and not yet answered
    released: bool = False

    def pages_for(self, rows: int, page_size: int) -> int:
        return (rows + page_size - 1) // page_size
