"""Arrays on the wire: raw little-endian bytes with dtype and shape, never lists of floats. The dtypes they
may travel in are ``dtypes.ALLOWED_DTYPES``. An array must not lie: every dim is a non-negative int and the
bytes are exactly the shape's element count times the dtype's size (``decode_array`` refuses the rest)."""

from __future__ import annotations

import math

import numpy as np

from .dtypes import ALLOWED_DTYPES
from .errors import ErrorCode, PieError


def encode_array(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a).reshape(np.shape(a))  # ascontiguousarray turns a 0-d array into 1-d
    if a.dtype.name not in ALLOWED_DTYPES:
        raise PieError(ErrorCode.INVALID_ARGUMENT, f"dtype {a.dtype.name} cannot travel on the wire")
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.astype(a.dtype.newbyteorder("<")).tobytes()}


def decode_array(obj: dict) -> np.ndarray:
    try:
        dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
        if dtype not in ALLOWED_DTYPES or not isinstance(data, bytes):
            raise ValueError(f"bad dtype {dtype!r}")
        if not isinstance(shape, (list, tuple)) or any(type(d) is not int or d < 0 for d in shape):
            raise ValueError(f"shape must be a list of non-negative ints, got {shape!r}")
        dt = np.dtype(dtype).newbyteorder("<")
        if len(data) != math.prod(shape) * dt.itemsize:
            raise ValueError(f"{len(data)} bytes do not hold shape {list(shape)} of {dtype}")
        arr = np.frombuffer(data, dtype=dt).reshape(shape)
    except (KeyError, TypeError, ValueError) as e:
        raise PieError(ErrorCode.BAD_MESSAGE, f"malformed array: {e}") from None
    return arr.astype(arr.dtype.newbyteorder("="), copy=False)
