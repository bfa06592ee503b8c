"""Dtypes on the wire, defined once: the dtypes a channel's cells may have (each with the value kind it has
in an epilogue program) and the dtypes an array may travel in. The channel-open message, the program rules
and the engine's torch dtypes (``engine/channels.py``) all key on these names."""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

Kind = Literal["float", "int", "bool"]
KINDS: tuple[str, ...] = get_args(Kind)  # a program value's dtype kind

ChannelDtype = Literal["float32", "float16", "int32", "int64", "bool"]
_KIND_OF = {"f": "float", "i": "int", "b": "bool"}  # numpy's dtype.kind → a program kind
CHANNEL_DTYPES: dict[str, str] = {name: _KIND_OF[np.dtype(name).kind] for name in get_args(ChannelDtype)}

# what an array may travel in: a channel's cells, packed readout masks (uint32 words), bytes, and bfloat16 K/V's
# raw bits (uint16: messages.KV_WIRE_DTYPES)
ALLOWED_DTYPES = frozenset({*CHANNEL_DTYPES, "uint32", "uint8", "uint16"})
