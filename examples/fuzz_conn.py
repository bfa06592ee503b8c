"""The engine fuzzer's side of the wire (docs/architecture.md, "The wire"): one raw DEALER connection that
packs its own msgpack maps and matches replies by id, the handles a case may abuse, and what a case returns
(``Msg``). The cases are in ``examples/fuzz_cases.py``, the runner in ``examples/fuzz_engine.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from pie_runtime.protocol.codec import MAX_MESSAGE_BYTES

BOUND_S = 10.0  # every message (waits included) must be answered within this
GREEDY_PROMPT = [1, 504, 3303, 28, 19, 42, 314, 260]  # token ids, all below any served vocabulary
_NO_ID = object()  # a request built without an id: one is assigned


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # pyright: ignore[reportReturnType]


def reply_key(payload: bytes) -> Any:
    """The id the engine's reply will carry: the request's id when it reads as an int, else None (also for a
    message over the size limit, refused before it is read)."""
    if len(payload) > MAX_MESSAGE_BYTES:
        return None
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated types
        return None
    if isinstance(obj, dict):
        rid = obj.get("id")
        return rid if isinstance(rid, int) else None
    return None


def short_repr(obj: Any, limit: int = 160) -> str:
    """A bounded repr: long lists, bytes and deep nests are elided."""

    def trim(o: Any, depth: int) -> Any:
        if depth > 4:
            return "…"
        if isinstance(o, dict):
            return {k: trim(v, depth + 1) for k, v in list(o.items())[:8]}
        if isinstance(o, list):
            head = [trim(v, depth + 1) for v in o[:4]]
            return head + [f"…{len(o)} items"] if len(o) > 4 else head
        if isinstance(o, (bytes, bytearray)):
            return f"<{len(o)} bytes>" if len(o) > 16 else bytes(o)
        if isinstance(o, str) and len(o) > 40:
            return o[:40] + "…"
        return o

    text = repr(trim(obj, 0))
    return text if len(text) <= limit else text[:limit] + "…"


@dataclass
class Msg:
    """One hostile message: its kind (for the report), its bytes and a short description."""

    kind: str
    payload: bytes
    desc: str
    op: str | None = None  # the op it claims, to track handles its reply creates


class EngineDied(Exception):
    pass


class CallError(RuntimeError):
    """A valid request (the fuzzer's setup, the valid client's checks) refused with an error reply."""

    def __init__(self, op: str, error: dict):
        self.code = str(error.get("code"))
        super().__init__(f"{op} failed: {self.code}: {error.get('message')}")


class Conn:
    """A raw DEALER with request ids, replies matched by id (or None for unreadable ids)."""

    def __init__(self, ctx: zmq.Context, address: str, alive: Callable[[], bool], first_id: int = 1000):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.alive = alive
        self.next_id = first_id

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def build(self, kind: str, obj: Any, op: str | None = None) -> Msg:
        if isinstance(obj, dict) and obj.get("id", None) is _NO_ID:
            obj = {**obj, "id": self.new_id()}
        if op is None and isinstance(obj, dict) and isinstance(obj.get("op"), str):
            op = obj["op"]
        return Msg(kind, pack(obj), short_repr(obj), op)

    def recv(self, timeout_s: float) -> dict | None:
        """One reply, or None after ``timeout_s``; raises EngineDied when the engine process is gone."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if self.sock.poll(int(max(0.0, min(left, 0.2)) * 1000)):
                obj = msgpack.unpackb(self.sock.recv(), raw=False, strict_map_key=False)
                return obj if isinstance(obj, dict) else {"id": None, "ok": False, "error": {"code": "not_a_map"}}
            if not self.alive():
                raise EngineDied("the engine process exited")
            if left <= 0:
                return None

    def call(self, op: str, timeout_s: float = BOUND_S, **fields: Any) -> dict:
        """A valid request and its reply (raises on a timeout or an error reply)."""
        rid = self.new_id()
        self.sock.send(pack({"id": rid, "op": op, **fields}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = self.recv(deadline - time.monotonic())
            if reply is not None and reply.get("id") == rid:
                if not reply.get("ok"):
                    raise CallError(op, reply.get("error") or {})
                return reply
        raise TimeoutError(f"{op} not answered within {timeout_s} s")

    def close(self) -> None:
        self.sock.close(0)


# ---- the hostile cases -------------------------------------------------------------------------------------


@dataclass
class Handles:
    """What the fuzzing client holds (and a victim's handles, which it must not be able to touch)."""

    model: str
    vocab: int
    ws: list[int]
    channels: list[int]  # shape [1] int32, capacity 1
    program: str  # logits(rows=[0]) → argmax → put(slot 0, [1] int32)
    foreign_ws: int
    foreign_channel: int
