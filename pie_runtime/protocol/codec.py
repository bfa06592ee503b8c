"""msgpack framing and request validation: bytes in, a typed request (or a PieError) out."""

from __future__ import annotations

from typing import Any, cast

import msgpack
from pydantic import TypeAdapter, ValidationError

from .errors import ErrorCode, PieError
from .messages import REQUEST_OPS, Request

MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_request_adapter: TypeAdapter = TypeAdapter(Request)


def pack(obj: Any) -> bytes:
    return cast(bytes, msgpack.packb(obj, use_bin_type=True))  # None only with autoreset=False


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def parse_request(data: bytes) -> tuple[int | None, Any]:
    """Returns (id, request). A refusal raises PieError whose ``request_id`` is whatever id could be read."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise PieError(ErrorCode.MESSAGE_TOO_LARGE, f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = unpack(data)
    except msgpack.StackError:  # msgpack's own bound on nesting (about 1,000 levels): no recursion past it
        raise PieError(ErrorCode.BAD_MESSAGE, "not msgpack: nested too deep") from None
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types
        raise PieError(ErrorCode.BAD_MESSAGE, f"not msgpack: {type(e).__name__}") from None
    if not isinstance(obj, dict):
        raise PieError(ErrorCode.BAD_MESSAGE, "a message must be a map")
    req_id = obj.get("id")
    try:
        if obj.get("op") not in REQUEST_OPS:
            raise PieError(ErrorCode.UNKNOWN_OP, f"unknown op {obj.get('op')!r}")
        try:
            return req_id, _request_adapter.validate_python(obj)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"][1:]) or "message"
            raise PieError(ErrorCode.BAD_MESSAGE, f"{where}: {first['msg']}") from None
    except PieError as e:
        e.request_id = req_id if isinstance(req_id, int) else None  # so the refusal reaches the waiting caller
        raise


def parse_reply(data: bytes) -> dict:
    obj = unpack(data)
    if not isinstance(obj, dict) or "id" not in obj:
        raise PieError(ErrorCode.BAD_MESSAGE, "malformed reply")
    return obj
