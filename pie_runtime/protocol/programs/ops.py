"""The vocabulary of epilogue programs: the closed op set by group and each op's arity, the limits, what a
value is (``Spec``: a static shape and a dtype kind) and what the readout intrinsics' shapes depend on
(``ModelDims``).

Limits: at most ``MAX_NODES`` nodes; every value of rank <= ``MAX_RANK`` and <= ``MAX_ELEMENTS`` elements; a
constant of <= ``MAX_CONST_ELEMENTS`` numbers; every attribute nested <= ``MAX_ATTR_DEPTH`` lists deep (checked
without recursion), <= ``MAX_ATTR_ITEMS`` items per node and strings of <= ``MAX_ATTR_STR``; and a peak of live
value bytes (``check.peak_bytes``) within a budget, ``PROGRAM_MEMORY`` unless the engine is started with
another (``--program-memory``): the SDK cannot know the engine's flag, so only the engine checks the budget."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ErrorCode, PieError

MAX_NODES = 512
MAX_RANK = 4
MAX_ELEMENTS = 1 << 24  # per value: (rows, k, vocab) MTP logits of a 17-row window stay well under
MAX_CONST_ELEMENTS = 4096
MAX_ATTR_DEPTH = MAX_RANK  # lists in an attribute nest at most this deep (a const's nesting is its rank)
MAX_ATTR_ITEMS = 2 * MAX_CONST_ELEMENTS  # numbers, strings and lists in one node's attributes, all told
MAX_ATTR_STR = 256  # characters (or bytes) of one string attribute
MAX_ROWS = 64
MAX_SLOTS = 16
MAX_DIM = 1 << 20
DTYPE_BYTES = {"float": 4, "int": 8, "bool": 1}  # what the interpreter materialises: float32, int64, bool
PROGRAM_MEMORY = 256 << 20  # default budget of a program's peak live bytes (the engine's --program-memory)

BINARY_ARITH = ("add", "sub", "mul", "div", "floordiv", "mod", "maximum", "minimum")
BINARY_CMP = ("eq", "ne", "lt", "le", "gt", "ge")
BINARY_BOOL = ("and", "or", "xor")
UNARY = ("neg", "abs", "exp", "log", "not")
REDUCE = ("sum", "max", "min", "argmax", "any", "all")
SCAN = ("cumsum", "cumprod", "softmax", "log_softmax")
SOURCES = ("logits", "hidden", "mtp_logits", "tokens", "const", "iota", "take", "read")
EFFECTS = ("put", "set", "fold")
CHANNEL_OPS = ("take", "read", "put", "set")  # the sources and effects that name a channel slot
OTHER = (
    "where",
    "cast",
    "masked_argmax",
    "sample",
    "uniform",
    "gather",
    "scatter",
    "slice",
    "index",
    "concat",
    "reshape",
    "mtp_logits_at",
)
PROGRAM_OPS = frozenset(SOURCES + EFFECTS + BINARY_ARITH + BINARY_CMP + BINARY_BOOL + UNARY + REDUCE + SCAN + OTHER)
ARITY = {
    **{op: 2 for op in BINARY_ARITH + BINARY_CMP + BINARY_BOOL},
    **{op: 1 for op in UNARY + REDUCE + SCAN},
    **{op: 0 for op in SOURCES},
    "put": 1,
    "set": 1,
    "fold": 1,
    "where": 3,
    "cast": 1,
    "masked_argmax": 2,
    "sample": 2,
    "uniform": 1,
    "gather": 2,
    "scatter": 3,
    "slice": 1,
    "index": 1,
    "reshape": 1,
    "mtp_logits_at": 1,
}  # concat takes 1..MAX_NODES inputs (its rule checks)


@dataclass(frozen=True)
class Spec:
    """A value's static shape and dtype kind."""

    shape: tuple[int, ...]
    kind: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor the engine's interpreter holds for this value."""
        return self.numel * DTYPE_BYTES[self.kind]


@dataclass(frozen=True)
class ModelDims:
    """What the readout intrinsics' shapes depend on."""

    vocab: int
    hidden: int
    mtp_depth: int = 0


def bad(node: int, msg: str) -> PieError:
    return PieError(ErrorCode.INVALID_PROGRAM, f"node {node}: {msg}")
