"""Device channels: bounded queues of fixed-shape cells held by the engine on a model's device.

The host puts, sets (replaces the front cell), takes (consumes) and reads (copies); an epilogue does the same
through a :class:`Txn`, whose writes land only when the whole fire succeeds. A fire that fails poisons the
channels it writes: the error is kept and surfaces at the next take or read, until the channel is closed.

Limits, checked when a channel opens (``limit_exceeded``, naming the limit): a cell holds at most
``MAX_CELL_ELEMENTS`` elements and a channel at most ``MAX_CHANNEL_ELEMENTS`` (cell elements times capacity);
the channels one client identity holds open at once (all its connections', identities.py), together, at most
``MAX_IDENTITY_CHANNEL_BYTES`` at their full capacity (a tenant that opened many channels, on as many
connections as it likes, and filled them could otherwise hold any amount of the device's memory).
A host put or set must match the channel's dtype and shape exactly (no cast: ``invalid_argument``); an
epilogue's writes are checked by the program's rules before it runs. A host take whose ``min`` (at most its
``max``) exceeds the channel's capacity could never be served and is refused (``invalid_argument``).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..protocol import ErrorCode, PieError
from ..protocol.arrays import encode_array
from ..protocol.dtypes import CHANNEL_DTYPES
from .identities import MAX_IDENTITY_CHANNEL_BYTES, Identities

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in CHANNEL_DTYPES}
MAX_CELL_ELEMENTS = 1 << 20  # elements of one cell
MAX_CHANNEL_ELEMENTS = 1 << 24  # elements of a channel: a cell's times its capacity


@dataclass(eq=False)
class Channel:
    id: int
    owner: bytes
    model: str
    shape: tuple[int, ...]
    dtype: str
    capacity: int
    device: torch.device
    cells: deque[torch.Tensor] = field(default_factory=deque)
    poison: PieError | None = None

    @property
    def free(self) -> int:
        return self.capacity - len(self.cells)

    @property
    def nbytes(self) -> int:
        """The bytes the channel holds when full."""
        return math.prod(self.shape) * self.capacity * TORCH_DTYPES[self.dtype].itemsize

    def check_live(self) -> None:
        if self.poison is not None:
            raise PieError(
                ErrorCode.CHANNEL_POISONED,
                f"channel {self.id}: a fire that writes it failed: {self.poison.code.value}: {self.poison.message}",
            )

    def cell(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as one cell of this channel (on its device, in its dtype); refuses another shape."""
        if tuple(value.shape) != self.shape:
            raise PieError(
                ErrorCode.INVALID_ARGUMENT,
                f"channel {self.id} holds cells of shape {list(self.shape)}, got {list(value.shape)}",
            )
        return value.to(device=self.device, dtype=TORCH_DTYPES[self.dtype]).clone()

    def check_host_value(self, value: np.ndarray) -> None:
        """A host's put or set: the data must have the channel's dtype and shape exactly (nothing is cast)."""
        if value.dtype.name != self.dtype or tuple(value.shape) != self.shape:
            raise PieError(
                ErrorCode.INVALID_ARGUMENT,
                f"channel {self.id} holds {self.dtype} cells of shape {list(self.shape)}, "
                f"got {value.dtype.name} of shape {list(value.shape)}",
            )

    def put(self, value: torch.Tensor) -> None:
        self.check_live()
        cell = self.cell(value)
        if not self.free:
            raise PieError(ErrorCode.CHANNEL_FULL, f"channel {self.id} holds its capacity of {self.capacity} cells")
        self.cells.append(cell)

    def set(self, value: torch.Tensor) -> None:
        self.check_live()
        if self.cells:
            self.cells[0] = self.cell(value)
        else:
            self.put(value)


class Txn:
    """A fire's view of its bound channels: takes, reads, puts and sets on staged copies, applied together by
    ``commit`` or dropped (and the written channels poisoned) by ``fail``."""

    def __init__(self, bindings: list[Channel]):
        self.bindings = bindings
        self._staged: dict[int, list[torch.Tensor]] = {}
        self.puts: dict[int, list[torch.Tensor]] = {}  # slot → cells put, in order (run-ahead reads its output)

    def _cells(self, slot: int) -> list[torch.Tensor]:
        if slot not in self._staged:
            ch = self.bindings[slot]
            ch.check_live()
            self._staged[slot] = list(ch.cells)
        return self._staged[slot]

    def take(self, slot: int) -> torch.Tensor:
        cells = self._cells(slot)
        if not cells:
            raise PieError(ErrorCode.CHANNEL_EMPTY, f"the epilogue takes from empty channel {self.bindings[slot].id}")
        return cells.pop(0)

    def read(self, slot: int) -> torch.Tensor:
        cells = self._cells(slot)
        if not cells:
            raise PieError(ErrorCode.CHANNEL_EMPTY, f"the epilogue reads empty channel {self.bindings[slot].id}")
        return cells[0]

    def put(self, slot: int, value: torch.Tensor) -> None:
        cell = self.bindings[slot].cell(value)
        self._cells(slot).append(cell)
        self.puts.setdefault(slot, []).append(cell)

    def set(self, slot: int, value: torch.Tensor) -> None:
        cells = self._cells(slot)
        cell = self.bindings[slot].cell(value)
        if cells:
            cells[0] = cell
        else:
            cells.append(cell)

    def commit(self) -> None:
        for slot, cells in self._staged.items():
            ch = self.bindings[slot]
            if len(cells) > ch.capacity:
                raise PieError(
                    ErrorCode.CHANNEL_FULL,
                    f"the epilogue leaves {len(cells)} cells in channel {ch.id} of capacity {ch.capacity}",
                )
        for slot, cells in self._staged.items():
            self.bindings[slot].cells = deque(cells)


def poison(channels: list[Channel], error: PieError) -> None:
    for ch in channels:
        if ch.poison is None:
            ch.poison = error


@dataclass
class Waiter:
    """A host take or read that waits for an in-flight fire to write its channel."""

    client: bytes
    req_id: int
    channel: int
    max: int
    consume: bool
    min: int = 1


class ChannelTable:
    """The channels of every client, and the host takes and reads waiting on them."""

    def __init__(self, identities: Identities | None = None) -> None:
        self.channels: dict[int, Channel] = {}
        self.waiters: list[Waiter] = []
        self.identities = identities or Identities()
        self._ids = itertools.count(1)

    def held_by(self, owner: bytes) -> list[Channel]:
        """The open channels of ``owner``'s identity (all its clients')."""
        identity = self.identities.of(owner)
        return [c for c in self.channels.values() if self.identities.of(c.owner) == identity]

    def open(
        self, owner: bytes, model: str, shape: list[int], dtype: str, capacity: int, device: torch.device
    ) -> Channel:
        if any(d < 1 for d in shape):
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"channel dims must be >= 1, got {shape}")
        cell = math.prod(shape)
        if cell > MAX_CELL_ELEMENTS:
            raise PieError(
                ErrorCode.LIMIT_EXCEEDED,
                f"a channel cell holds at most MAX_CELL_ELEMENTS={MAX_CELL_ELEMENTS} elements, got {cell}",
            )
        if cell * capacity > MAX_CHANNEL_ELEMENTS:
            raise PieError(
                ErrorCode.LIMIT_EXCEEDED,
                f"a channel holds at most MAX_CHANNEL_ELEMENTS={MAX_CHANNEL_ELEMENTS} elements "
                f"(cell elements x capacity), got {cell} x {capacity}",
            )
        ch = Channel(next(self._ids), owner, model, tuple(shape), dtype, capacity, device)
        held = sum(c.nbytes for c in self.held_by(owner))
        if held + ch.nbytes > MAX_IDENTITY_CHANNEL_BYTES:
            raise PieError(
                ErrorCode.LIMIT_EXCEEDED,
                f"MAX_IDENTITY_CHANNEL_BYTES: a client's identity (all its connections) holds open channels of at "
                f"most {MAX_IDENTITY_CHANNEL_BYTES} bytes together (at full capacity); it holds {held} and asks "
                f"{ch.nbytes} more: close one first",
            )
        self.channels[ch.id] = ch
        return ch

    def get(self, owner: bytes, cid: int) -> Channel:
        ch = self.channels.get(cid)
        if ch is None or ch.owner != owner:
            raise PieError(ErrorCode.UNKNOWN_CHANNEL, f"no channel {cid} (never opened, or closed)")
        return ch

    def close(self, ch: Channel) -> None:
        self.channels.pop(ch.id, None)

    def drop_client(self, owner: bytes) -> None:
        for ch in [c for c in self.channels.values() if c.owner == owner]:
            self.close(ch)
        self.waiters = [w for w in self.waiters if w.client != owner]

    def take(
        self,
        client: bytes,
        req_id: int,
        ch: Channel,
        n: int,
        consume: bool,
        has_writer: Callable[[Channel], bool],
        at_least: int = 1,
    ) -> dict | None:
        """The reply to a host take or read, or None when it waits for a fire in flight."""
        w = Waiter(client, req_id, ch.id, n, consume, min(at_least, n))
        reply = self._try(w, has_writer)
        if reply is None:
            self.waiters.append(w)
            return None
        if not reply["ok"]:
            raise PieError(reply["error"]["code"], reply["error"]["message"])
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    def serve(self, has_writer: Callable[[Channel], bool]) -> list[tuple[bytes, dict]]:
        """Answers every waiter that can be answered now (after a step, or after a host put)."""
        out, still = [], []
        for w in self.waiters:
            reply = self._try(w, has_writer)
            if reply is None:
                still.append(w)
            else:
                out.append((w.client, reply))
        self.waiters = still
        return out

    def _try(self, w: Waiter, has_writer: Callable[[Channel], bool]) -> dict | None:
        ch = self.channels.get(w.channel)
        try:
            if ch is None:
                raise PieError(ErrorCode.UNKNOWN_CHANNEL, f"channel {w.channel} was closed")
            ch.check_live()
            if len(ch.cells) < w.min and has_writer(ch):
                return None
            if not ch.cells:
                raise PieError(ErrorCode.CHANNEL_EMPTY, f"channel {ch.id} is empty and no fire in flight writes it")
        except PieError as e:
            return {"id": w.req_id, "ok": False, "error": e.to_wire()}
        if not w.consume:
            return {"id": w.req_id, "ok": True, "value": _wire(ch.cells[0])}
        cells = [ch.cells.popleft() for _ in range(min(w.max, len(ch.cells)))]
        return {"id": w.req_id, "ok": True, "value": _wire(torch.stack(cells)), "count": len(cells)}


def _wire(t: torch.Tensor) -> dict:
    return encode_array(t.cpu().numpy())
