"""Channels: bounded queues of fixed-shape cells held by the engine on a model's device. Epilogues write
them with no round trip; the host puts, sets, takes and reads them with one message each."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pie_runtime.protocol.arrays import decode_array, encode_array

if TYPE_CHECKING:
    from .model import Model


class Channel:
    """A bounded queue of fixed-shape cells on the model's device (``await Channel.open(model, shape, dtype,
    capacity)``): an epilogue program reads and writes it during a fire; the host puts, sets, takes and reads
    it with one message each. ``close`` frees it (a run's channels are closed when it ends)."""

    def __init__(self, model: Model, handle: int, shape: tuple[int, ...], dtype: str, capacity: int):
        self.model, self.handle, self.shape, self.dtype, self.capacity = model, handle, shape, dtype, capacity

    @classmethod
    async def open(cls, model: Model, shape, dtype: str = "int32", capacity: int = 1) -> Channel:
        shape = tuple(int(d) for d in shape)
        reply = await model.client.request(
            "channel_open", model=model.name, shape=list(shape), dtype=dtype, capacity=int(capacity)
        )
        return cls(model, reply["channel"], shape, dtype, capacity)

    def _wire(self, value) -> dict:
        return encode_array(np.asarray(value, dtype=self.dtype).reshape(self.shape))

    async def put(self, value) -> int:
        """Appends one cell; a full channel refuses with CHANNEL_FULL. Returns the channel's size."""
        return (await self.model.client.request("channel_put", channel=self.handle, value=self._wire(value)))["size"]

    async def set(self, value) -> int:
        """Replaces the front cell (puts one into an empty channel)."""
        return (await self.model.client.request("channel_set", channel=self.handle, value=self._wire(value)))["size"]

    async def take(self, max: int = 1, min: int = 1) -> np.ndarray:
        """Consumes 1..max cells, (n, *shape); waits while fewer than ``min`` are there and a fire in flight
        writes the channel. An empty channel nobody writes raises CHANNEL_EMPTY; one a failed fire wrote,
        CHANNEL_POISONED."""
        reply = await self.model.client.request("channel_take", channel=self.handle, max=int(max), min=int(min))
        return decode_array(reply["value"])

    async def read(self) -> np.ndarray:
        """A copy of the front cell; waits like ``take``."""
        return decode_array((await self.model.client.request("channel_read", channel=self.handle))["value"])

    async def close(self) -> None:
        await self.model.client.request("channel_close", channel=self.handle)
