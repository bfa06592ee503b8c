"""Epilogue programs on the wire: the closed op set, its static shape and dtype rules, limits, and the
canonical encoding whose hash names a program.

A program is a list of nodes ``{"op", "inputs": [node ids], "attrs": {...}}`` in topological order (a node
may only read earlier nodes, so there are no cycles). Every value has a static shape and one of three dtype
kinds: ``float``, ``int``, ``bool``. The SDK's tracer and the engine's validator both run ``infer`` here, so
a program the SDK builds is checked by the same rules the engine enforces. Pure Python: no torch.

``ops``: the op set, arities, limits, ``Spec``; ``rules``: each op's shape and dtype rule; ``check``: ``infer``,
``check_program`` and ``program_hash``.
"""

from .check import check_attrs, check_program, infer, last_uses, peak_bytes, program_hash
from .ops import (
    ARITY,
    CHANNEL_OPS,
    DTYPE_BYTES,
    MAX_ATTR_DEPTH,
    MAX_ATTR_ITEMS,
    MAX_ATTR_STR,
    MAX_CONST_ELEMENTS,
    MAX_DIM,
    MAX_ELEMENTS,
    MAX_NODES,
    MAX_RANK,
    MAX_ROWS,
    MAX_SLOTS,
    PROGRAM_MEMORY,
    PROGRAM_OPS,
    ModelDims,
    Spec,
    bad,
)
from .rules import RULES

__all__ = [
    "ARITY",
    "CHANNEL_OPS",
    "DTYPE_BYTES",
    "MAX_ATTR_DEPTH",
    "MAX_ATTR_ITEMS",
    "MAX_ATTR_STR",
    "MAX_CONST_ELEMENTS",
    "MAX_DIM",
    "MAX_ELEMENTS",
    "MAX_NODES",
    "MAX_RANK",
    "MAX_ROWS",
    "MAX_SLOTS",
    "PROGRAM_MEMORY",
    "PROGRAM_OPS",
    "RULES",
    "ModelDims",
    "Spec",
    "bad",
    "check_attrs",
    "check_program",
    "infer",
    "last_uses",
    "peak_bytes",
    "program_hash",
]
