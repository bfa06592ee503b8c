"""The control channel between the server (``host_pool.HostPool``) and its inferlet host processes
(``inferlet_host.py``).

One ZeroMQ ROUTER socket in the server on an ``ipc://`` address (``tcp://`` when the hosts run on other nodes,
under ``pie serve --engines N --ray-address ...``), one DEALER per host whose identity is the host's spawn id;
one msgpack map a message, ``{"t": kind, ...}``, validated by these pydantic models on arrival (a message
that does not validate is dropped and logged, never trusted).

    server → host:  run {run, inferlet, path, args}  ·  cancel {run}  ·  stop
    host → server:  ready {pid}  ·  hb  ·  text {run, text, logprobs?}  ·  result {run, result}
                    ·  error {run, code, message}

A host sends ``hb`` from its event loop every heartbeat interval: a host whose loop is blocked (an inferlet
spinning without awaiting) misses them, and the server kills and restarts it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

FailCode = Literal["inferlet_error", "cancelled", "bad_arguments", "not_found"]  # what a host reports


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StartRun(_Msg):
    t: Literal["run"] = "run"
    run: str
    inferlet: str  # the name the run reports under (engine stats), also the module's cache key with ``path``
    path: str
    args: dict[str, Any]
    cache_salt: str | None = None  # the prefix-cache salt of its working sets (its API key's)


class CancelRun(_Msg):
    t: Literal["cancel"] = "cancel"
    run: str


class Stop(_Msg):
    t: Literal["stop"] = "stop"


class Ready(_Msg):
    t: Literal["ready"] = "ready"
    pid: int


class Heartbeat(_Msg):
    t: Literal["hb"] = "hb"


class Text(_Msg):
    t: Literal["text"] = "text"
    run: str
    text: str
    logprobs: list[dict[str, Any]] | None = None  # its tokens' logprobs entries, when the run records them


class Result(_Msg):
    t: Literal["result"] = "result"
    run: str
    result: Any


class Error(_Msg):
    t: Literal["error"] = "error"
    run: str
    code: FailCode
    message: str


ToHost = Annotated[StartRun | CancelRun | Stop, Field(discriminator="t")]
ToServer = Annotated[Ready | Heartbeat | Text | Result | Error, Field(discriminator="t")]
_to_host: TypeAdapter[StartRun | CancelRun | Stop] = TypeAdapter(ToHost)
_to_server: TypeAdapter[Ready | Heartbeat | Text | Result | Error] = TypeAdapter(ToServer)


def encode(msg: _Msg) -> bytes:
    data = msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)
    assert data is not None  # packb without a stream returns the bytes
    return data


def encode_text(run: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> bytes:
    """``encode(Text(...))`` without building the model: a host sends one a token."""
    data = msgpack.packb({"t": "text", "run": run, "text": text, "logprobs": logprobs}, use_bin_type=True)
    assert data is not None
    return data


def decode_to_host(data: bytes) -> StartRun | CancelRun | Stop:
    return _to_host.validate_python(msgpack.unpackb(data, raw=False))


def decode_to_server(data: bytes) -> Ready | Heartbeat | Text | Result | Error:
    return _to_server.validate_python(msgpack.unpackb(data, raw=False))
