"""Arrays on the wire: raw little-endian bytes with dtype and shape, never lists of floats. The dtypes they
may travel in are ``dtypes.ALLOWED_DTYPES``."""

from __future__ import annotations

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
        arr = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
    except (KeyError, TypeError, ValueError) as e:
        raise PieError(ErrorCode.BAD_MESSAGE, f"malformed array: {e}") from None
    return arr.astype(arr.dtype.newbyteorder("="), copy=False)
