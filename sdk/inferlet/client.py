"""The SDK's connection to the engine: one ZeroMQ DEALER socket, msgpack requests matched to replies by id.
It speaks only the wire protocol (``pie_runtime.protocol``) and never imports engine code.

Many runs may share one connection (an inferlet host). Each run's ``Holdings``, set in its context with
``holding()``, records the working sets and channels the run's own requests opened, so that whatever the
run did not release can be released when it ends, even when it was cancelled mid-request."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol.codec import pack, parse_reply

# request op → (the reply field naming what it opened, the kind); release op → (its request field, the kind)
_OPENS = {"ws_open": ("ws", "ws"), "ws_fork": ("ws", "ws"), "channel_open": ("channel", "channel")}
_CLOSES = {"ws_release": ("ws", "ws"), "channel_close": ("channel", "channel")}
_RELEASE_OP = {"ws": "ws_release", "channel": "channel_close"}


@dataclass
class Holdings:
    """The engine-side objects one run opened and has not released yet."""

    working_sets: set[int] = field(default_factory=set)
    channels: set[int] = field(default_factory=set)
    closed: bool = False  # the run has ended: whatever is opened from now on is released at once

    def bucket(self, kind: str) -> set[int]:
        """The handles of one kind ("ws" or "channel")."""
        return self.working_sets if kind == "ws" else self.channels

    def leftovers(self) -> list[tuple[str, int]]:
        """(release op, handle) for each: working sets first, since their fires may write the channels."""
        return [("ws_release", h) for h in sorted(self.working_sets)] + [
            ("channel_close", h) for h in sorted(self.channels)
        ]


_holdings: contextvars.ContextVar[Holdings | None] = contextvars.ContextVar("inferlet_holdings", default=None)


def holding(holdings: Holdings | None) -> contextvars.Token:
    """Makes the requests of the current context (and of the tasks it creates) record into ``holdings``."""
    return _holdings.set(holdings)


def release_holding(token: contextvars.Token) -> None:
    _holdings.reset(token)


@dataclass
class _Pending:
    future: asyncio.Future
    op: str
    holdings: Holdings | None


class Client:
    def __init__(self, address: str):
        self.address = address
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._reader: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    async def request(self, op: str, **fields: Any) -> dict:
        """Sends one request and waits for its reply; a refusal raises PieError with the engine's code."""
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.done():
            # a context of its own: the reader must not inherit (and record into) a run's holdings
            self._reader = loop.create_task(self._read_replies(), context=contextvars.Context())
        holdings = _holdings.get()
        if holdings is not None and op in _CLOSES:
            key, kind = _CLOSES[op]
            holdings.bucket(kind).discard(fields.get(key))  # type: ignore[arg-type]
        req_id = next(self._ids)
        fut = loop.create_future()
        self._pending[req_id] = _Pending(fut, op, holdings)
        await self._sock.send(pack({"id": req_id, "op": op, **fields}))
        reply = await fut
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise PieError(err.get("code", ErrorCode.INTERNAL.value), err.get("message", "unknown error"))
        return reply

    async def release(self, holdings: Holdings) -> int:
        """Releases what ``holdings`` still holds and closes it; returns how many objects that was."""
        holdings.closed = True
        leftovers = holdings.leftovers()
        holdings.working_sets.clear()
        holdings.channels.clear()
        for op, handle in leftovers:
            await self._release_one(op, handle)
        return len(leftovers)

    async def _release_one(self, op: str, handle: int) -> None:
        """One release outside any run's holdings; an object already gone is no error here."""
        token = _holdings.set(None)
        try:
            await self.request(op, **{_CLOSES[op][0]: handle})
        except PieError:
            pass
        finally:
            _holdings.reset(token)

    async def send_raw(self, payload: bytes) -> dict:
        """Sends bytes as they are (for tests of the engine's input checks); returns the next unmatched reply."""
        await self._sock.send(payload)
        return parse_reply(await self._sock.recv())

    async def _read_replies(self) -> None:
        while True:
            reply = parse_reply(await self._sock.recv())
            pending = self._pending.pop(reply["id"], None)  # parse_reply checked there is one
            if pending is None:
                continue
            # recorded here, not in request(): a run cancelled while its ws_open was in flight still owns it
            if pending.holdings is not None and reply.get("ok") and pending.op in _OPENS:
                self._record(pending.holdings, pending.op, reply)
            if not pending.future.done():
                pending.future.set_result(reply)

    def _record(self, holdings: Holdings, op: str, reply: dict) -> None:
        key, kind = _OPENS[op]
        handle = reply.get(key)
        if not isinstance(handle, int):
            return
        if not holdings.closed:
            holdings.bucket(kind).add(handle)
            return
        # the run ended before this reply came: nobody will release it but us
        task = asyncio.get_running_loop().create_task(
            self._release_one(_RELEASE_OP[kind], handle), context=contextvars.Context()
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(0)
