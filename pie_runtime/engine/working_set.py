"""Working sets: one sequence's page table and committed length, with the fold rule of docs/working-sets.md
("The working set and its deferred fold"), and the table of every client's working sets.

Rows ``0 .. committed-1`` are frozen. A fire writes rows ``committed ..`` unfrozen; its fold moves
``committed`` forward by the fold count, and the rows past it are overwritten by the next fire. An eviction
(``ws_evict``) drops committed rows and closes the gaps: a row's index then differs from its position, which
stays the one it was written at, and a new row's position is ``committed + dropped``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ..protocol import ErrorCode, PieError
from ..protocol.tree import Fold, fold_path
from .prefix_cache import PageChain
from .state_slots import SlotHold


@dataclass(frozen=True)
class TreeWindow:
    """The window of a tree fire (protocol.tree), kept while its fold is open: what a fold path is checked
    against and which tokens its rows hold once folded."""

    parents: tuple[int, ...]
    tokens: tuple[int, ...]


@dataclass
class WorkingSet:
    id: int
    owner: bytes  # the client identity that opened it
    model: str
    # one page table per KV page group (models/kv_groups.py; one group but for sliding-window models); -1 marks a
    # page a sliding group let go (engine/kv_pages.py)
    tables: list[list[int]] = field(default_factory=lambda: [[]])
    committed: int = 0
    dropped: int = 0  # committed rows evicted so far: the next row's position is committed + dropped
    # rows below it hold nothing in the sliding page groups even where their page is held: rows appended from a
    # saved working set whose sliding layers had let go of them (engine/kv_transfer.py)
    held_from: int = 0
    pending_fold: int | None = None  # window size of a fire whose fold is deferred and not yet settled
    pending_tree: TreeWindow | None = None  # that fire's tree, when it has one
    in_flight: int = 0  # fires accepted and not yet answered
    released: bool = False
    chain: PageChain = field(default_factory=PageChain)  # what the prefix cache can name of its rows
    state: SlotHold | None = None  # its recurrent-state slot (models with recurrent state only)
    replayed_rows: int = 0  # rows its folds replayed so far (engine/fold.py), reported in fire and fold replies
    # an EAGLE head's features of the last rows run (engine/runner.py's FeatureTail), opaque here
    drafter_tail: object | None = None

    @property
    def pages(self) -> list[int]:
        """Page group 0's table (the only one of a model without sliding layers)."""
        return self.tables[0]

    @pages.setter
    def pages(self, table: list[int]) -> None:
        self.tables[0] = table

    def check_settle(self, fold: Fold) -> list[int]:
        """Refuses to settle the deferred fold with ``fold`` (a count or a path) unless that fold is answered and
        ``fold`` fits its window; returns the window rows it commits, in order."""
        if self.in_flight:
            raise PieError(ErrorCode.BUSY, "fold after the deferred fire has been answered")
        if self.pending_fold is None:
            raise PieError(ErrorCode.NO_PENDING_FOLD, f"working set {self.id} has no deferred fold to settle")
        if isinstance(fold, int) and fold > self.pending_fold:
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"fold {fold} exceeds the fire's {self.pending_fold} rows")
        parents = self.pending_tree.parents if self.pending_tree is not None else None
        return fold_path(fold, parents, self.pending_fold)

    def position(self, row: int) -> int:
        """The position of a row written at index ``row`` from now on (a fire's default positions)."""
        return row + self.dropped


class WorkingSetTable:
    """Every open working set by handle; a client sees only its own."""

    def __init__(self) -> None:
        self._sets: dict[int, WorkingSet] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._sets)

    def open(self, owner: bytes, model: str, tables: list[list[int]] | None = None, committed: int = 0) -> WorkingSet:
        ws = WorkingSet(id=next(self._ids), owner=owner, model=model, tables=tables or [[]], committed=committed)
        self._sets[ws.id] = ws
        return ws

    def remove(self, ws: WorkingSet) -> None:
        ws.released = True
        self._sets.pop(ws.id, None)

    def all(self) -> list[WorkingSet]:
        return list(self._sets.values())

    def owned_by(self, client: bytes) -> list[WorkingSet]:
        return [ws for ws in self._sets.values() if ws.owner == client]

    def get(self, client: bytes, ws_id: int) -> WorkingSet:
        ws = self._sets.get(ws_id)
        if ws is None or ws.owner != client:
            raise PieError(ErrorCode.UNKNOWN_WORKING_SET, f"no working set {ws_id} (never opened, or released)")
        return ws

    def idle(self, client: bytes, ws_id: int) -> WorkingSet:
        """A working set with no fire in flight and no fold to settle (fork and truncate need one)."""
        ws = self.get(client, ws_id)
        if ws.in_flight:
            raise PieError(ErrorCode.BUSY, f"working set {ws.id} has fires in flight")
        if ws.pending_fold is not None:
            raise PieError(ErrorCode.FOLD_PENDING, f"working set {ws.id} has a deferred fold to settle first")
        return ws
