"""The wire contract between inferlets (through the SDK) and the engine: message schemas, the msgpack codec,
error codes and the protocol version. Importable without torch or zmq; the SDK imports nothing else of
pie_runtime."""

from .arrays import decode_array, encode_array
from .codec import MAX_MESSAGE_BYTES, pack, parse_reply, parse_request, unpack
from .errors import ErrorCode, PieError
from .messages import (
    PROTOCOL_VERSION,
    Fire,
    Hello,
    ModelInfo,
    Readout,
    ReadoutKind,
    Request,
)

__all__ = [
    "PROTOCOL_VERSION",
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
