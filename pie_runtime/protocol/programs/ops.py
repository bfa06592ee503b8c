"""The vocabulary of epilogue programs: the closed op set by group and each op's arity, the limits, what a
value is (``Spec``: a static shape and a dtype kind) and what the readout intrinsics' shapes depend on
(``ModelDims``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ErrorCode, PieError

MAX_NODES = 512
MAX_RANK = 4
MAX_ELEMENTS = 1 << 24  # per value: (rows, k, vocab) MTP logits of a 17-row window stay well under
MAX_CONST_ELEMENTS = 4096
MAX_ROWS = 64
MAX_SLOTS = 16
MAX_DIM = 1 << 20

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


@dataclass(frozen=True)
class ModelDims:
    """What the readout intrinsics' shapes depend on."""

    vocab: int
    hidden: int
    mtp_depth: int = 0


def bad(node: int, msg: str) -> PieError:
    return PieError(ErrorCode.INVALID_PROGRAM, f"node {node}: {msg}")
