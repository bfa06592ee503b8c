"""The SDK's connection to the engine: one ZeroMQ DEALER socket, msgpack requests matched to replies by id.
It speaks only the wire protocol (``pie_runtime.protocol``) and never imports engine code."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import zmq
import zmq.asyncio

from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol.codec import pack, parse_reply


class Client:
    def __init__(self, address: str):
        self.address = address
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def request(self, op: str, **fields: Any) -> dict:
        """Sends one request and waits for its reply; a refusal raises PieError with the engine's code."""
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_replies())
        req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        await self._sock.send(pack({"id": req_id, "op": op, **fields}))
        reply = await fut
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise PieError(err.get("code", ErrorCode.INTERNAL.value), err.get("message", "unknown error"))
        return reply

    async def send_raw(self, payload: bytes) -> dict:
        """Sends bytes as they are (for tests of the engine's input checks); returns the next unmatched reply."""
        await self._sock.send(payload)
        return parse_reply(await self._sock.recv())

    async def _read_replies(self) -> None:
        while True:
            reply = parse_reply(await self._sock.recv())
            fut = self._pending.pop(reply["id"], None)  # parse_reply checked there is one
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(0)
