"""The recurrent-state slot pool of a model with recurrent state (Mamba, LFM2), beside its KV pages.

Every working set of such a model holds one slot from open to release: its live state and, while a fire
runs or waits for its fold, a snapshot of the state from before that fire (docs/working-sets.md, "Working
sets that hold state"). This module knows slot numbers and which fire a slot's state has run through, never
tensors: the bytes live in ``models/state_cache.py`` and the copies are the runner's (``StateOps``).

``SlotHold.fire`` names the fire whose rows the live state has advanced through since the snapshot, with its
tokens and positions, so that a fold of fewer rows can restore the snapshot and replay them (engine/fold.py).
``ran`` is how many of its rows the live state holds, or ``DIRTY`` while a forward over them is in progress
(a forward that raises leaves the state unknown; the retry restores the snapshot and runs them again).
``keep`` is how many per-row states the fire leaves (the state after each of its rows 0 .. keep-1, kept by
the forward that runs them: execute.py), so a fold of n <= keep rows copies one instead of replaying.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..protocol import ErrorCode, PieError

DIRTY = -1


class StateOps(Protocol):
    """The tensor side, by slot: zero a live state, copy one slot's live state to another's, save a slot's live
    state as its snapshot, put the snapshot back, make the state after one of the fire's rows the live one."""

    def zero_state(self, slot: int) -> None: ...
    def copy_state(self, src: int, dst: int) -> None: ...
    def snapshot_state(self, slot: int) -> None: ...
    def restore_state(self, slot: int) -> None: ...
    def take_row_state(self, slot: int, row: int) -> None: ...


@dataclass
class SlotHold:
    slot: int
    fire: object | None = None  # the FireJob the live state has run through since the snapshot
    start: int = 0  # its first row's sequence index
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    ran: int = 0  # rows of it the live state holds (DIRTY: unknown)
    keep: int = 0  # per-row states the fire leaves: after each of its rows 0 .. keep-1


class StateSlots:
    def __init__(self, slots: int, ops: StateOps, rows: int = 0):
        if slots <= 0:
            raise ValueError("the state pool needs at least one slot")
        self.total = slots
        self.ops = ops
        self.rows = rows  # per-row states a slot can keep (0: every partial fold replays)
        self._free: list[int] = list(range(slots - 1, -1, -1))  # pop() hands out low slots first

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.total - len(self._free)

    def _take(self) -> int:
        if not self._free:
            raise PieError(
                ErrorCode.OUT_OF_STATE_SLOTS,
                f"all {self.total} recurrent-state slots are held (one per working set); release one, "
                "or start the engine with a larger --state-slots",
            )
        return self._free.pop()

    def open(self) -> SlotHold:
        """A fresh working set's slot, its state zeroed."""
        slot = self._take()
        self.ops.zero_state(slot)
        return SlotHold(slot)

    def fork(self, parent: SlotHold) -> SlotHold:
        """A slot holding a copy of ``parent``'s live state (the parent is idle: its state is its committed one)."""
        slot = self._take()
        self.ops.copy_state(parent.slot, slot)
        return SlotHold(slot)

    def release(self, hold: SlotHold) -> None:
        self._free.append(hold.slot)
        hold.fire = None

    def begin(
        self, hold: SlotHold, fire: object, start: int, tokens: list[int], positions: list[int], partial: bool
    ) -> None:
        """A fire's first rows are about to run: the live state is saved as the snapshot. ``partial``: its fold
        may keep fewer rows than it runs (deferred, or a count below its rows), so it keeps per-row states for
        as many of its rows as the pool holds (the last row's state is the live one)."""
        self.ops.snapshot_state(hold.slot)
        hold.fire, hold.start, hold.tokens, hold.positions, hold.ran = fire, start, tokens, positions, 0
        hold.keep = max(0, min(self.rows, len(tokens) - 1)) if partial else 0

    def end(self, hold: SlotHold) -> None:
        """The fire's rows are folded (or dropped): the live state is the committed one again."""
        hold.fire, hold.tokens, hold.positions, hold.ran, hold.keep = None, [], [], 0, 0
