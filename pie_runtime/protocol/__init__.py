"""The wire contract between inferlets (through the SDK) and the engine: message schemas (``messages``), the
msgpack codec, error codes, the protocol version, the dtypes that travel (``dtypes``) and epilogue programs'
rules (``programs``). Each wire fact is defined once here; the engine and the SDK key on it. Importable without
torch or zmq; the SDK imports nothing else of pie_runtime."""

from .arrays import decode_array, encode_array
from .codec import MAX_MESSAGE_BYTES, pack, parse_reply, parse_request, unpack
from .errors import ErrorCode, PieError
from .messages import (
    DEFERRED,
    PROTOCOL_VERSION,
    REQUEST_OPS,
    Fire,
    Hello,
    ModelInfo,
    Readout,
    ReadoutKind,
    Request,
)

__all__ = [
    "DEFERRED",
    "PROTOCOL_VERSION",
    "REQUEST_OPS",
    "MAX_MESSAGE_BYTES",
    "ErrorCode",
    "PieError",
    "Fire",
    "Hello",
    "ModelInfo",
    "Readout",
    "ReadoutKind",
    "Request",
    "decode_array",
    "encode_array",
    "pack",
    "unpack",
    "parse_request",
    "parse_reply",
]
