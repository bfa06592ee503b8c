"""Each op's static rule: the output ``Spec`` of a node from its inputs' specs and its attributes, or
INVALID_PROGRAM (UNSUPPORTED for MTP readouts of a model without an MTP drafter). ``@rule(ops)`` files a rule
under the ops it decides; ``check.infer`` looks it up in ``RULES``."""

from __future__ import annotations

import math
from collections.abc import Callable

from ..dtypes import CHANNEL_DTYPES, KINDS
from ..errors import ErrorCode, PieError
from .ops import (
    BINARY_ARITH,
    BINARY_BOOL,
    BINARY_CMP,
    CHANNEL_OPS,
    MAX_CONST_ELEMENTS,
    MAX_DIM,
    MAX_NODES,
    MAX_RANK,
    MAX_ROWS,
    MAX_SLOTS,
    REDUCE,
    SCAN,
    UNARY,
    ModelDims,
    Spec,
    bad,
)

# ---- attribute readers: each refuses a missing or mistyped attribute with INVALID_PROGRAM ------------------


def _int(i: int, attrs: dict, name: str, lo: int | None = None, hi: int | None = None, default=None) -> int:
    v = attrs.get(name, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(i, f"attribute {name!r} must be an int")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(i, f"attribute {name!r}={v} outside [{lo}, {hi}]")
    return v


def _float(i: int, attrs: dict, name: str, lo: float, hi: float, default=None) -> float:
    v = attrs.get(name, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise bad(i, f"attribute {name!r} must be a number in [{lo}, {hi}]")
    return float(v)


def _ints(i: int, attrs: dict, name: str, lo: int, hi: int, max_len: int) -> list[int]:
    v = attrs.get(name)
    if not isinstance(v, list) or not 0 < len(v) <= max_len:
        raise bad(i, f"attribute {name!r} must be a list of 1..{max_len} ints")
    for x in v:
        if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
            raise bad(i, f"attribute {name!r} holds {x!r}, outside [{lo}, {hi}]")
    return v


def _dim(i: int, attrs: dict, rank: int) -> int:
    if rank == 0:
        raise bad(i, "needs a tensor of rank >= 1")
    d = _int(i, attrs, "dim", -rank, rank - 1, default=-1)
    return d % rank


def _shape(i: int, attrs: dict, name: str = "shape") -> tuple[int, ...]:
    v = attrs.get(name)
    if not isinstance(v, list) or len(v) > MAX_RANK:
        raise bad(i, f"attribute {name!r} must be a list of at most {MAX_RANK} dims")
    for x in v:
        if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= MAX_DIM:
            raise bad(i, f"attribute {name!r} holds a bad dim {x!r}")
    return tuple(v)


def _channel(i: int, attrs: dict) -> tuple[int, tuple[int, ...], str]:
    slot = _int(i, attrs, "slot", 0, MAX_SLOTS - 1)
    dtype = attrs.get("dtype")
    if dtype not in CHANNEL_DTYPES:
        raise bad(i, f"channel dtype must be one of {sorted(CHANNEL_DTYPES)}")
    return slot, _shape(i, attrs), dtype


def const_shape(i: int, value) -> tuple[int, ...]:
    """Shape of a nested-list constant, walked level by level (no recursion, so no nesting can exhaust the
    stack); refuses ragged lists, non-numbers, nesting deeper than ``MAX_RANK`` and more than
    ``MAX_CONST_ELEMENTS`` numbers before looking further."""
    shape: list[int] = []
    level = [value]
    while True:
        if all(isinstance(v, (bool, int, float)) for v in level):
            return tuple(shape)
        if not all(isinstance(v, list) and v for v in level):
            if any(isinstance(v, (bool, int, float)) for v in level):
                raise bad(i, "a ragged constant")
            raise bad(i, "a constant is a number or a non-empty nested list of numbers")
        if len(shape) == MAX_RANK:
            raise bad(i, f"a constant nested deeper than {MAX_RANK} levels (the limit on rank)")
        n = len(level[0])
        if any(len(v) != n for v in level):
            raise bad(i, "a ragged constant")
        shape.append(n)
        if math.prod(shape) > MAX_CONST_ELEMENTS:
            raise bad(i, f"constant larger than {MAX_CONST_ELEMENTS} elements")
        level = [x for v in level for x in v]


def broadcast(i: int, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    rank = max(len(s) for s in shapes)
    out = []
    for d in range(rank):
        dims = {s[len(s) - rank + d] for s in shapes if len(s) - rank + d >= 0} - {1}
        if len(dims) > 1:
            raise bad(i, f"shapes {' and '.join(map(str, shapes))} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _numeric(i: int, *specs: Spec) -> str:
    if any(s.kind == "bool" for s in specs):
        raise bad(i, "arithmetic on bool (cast it first)")
    return "float" if any(s.kind == "float" for s in specs) else "int"


Rule = Callable[[int, str, list[Spec], dict, ModelDims], Spec | None]  # (node, op, inputs, attrs, dims) → output
RULES: dict[str, Rule] = {}  # op → its shape and dtype rule, one per op of the set (filled by @rule below)


def rule(*ops: str) -> Callable[[Rule], Rule]:
    """Makes the decorated function the rule of ``ops``."""

    def register(fn: Rule) -> Rule:
        for op in ops:
            assert op not in RULES, f"two rules for {op}"
            RULES[op] = fn
        return fn

    return register


def _no_mtp(i: int) -> PieError:
    return PieError(ErrorCode.UNSUPPORTED, f"node {i}: the model has no MTP drafter")


# ---- sources and effects -----------------------------------------------------------------------------------


@rule("logits", "hidden", "mtp_logits")
def _readout(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    rows = _ints(i, a, "rows", 0, MAX_DIM, MAX_ROWS)
    if op == "logits":
        return Spec((len(rows), dims.vocab), "float")
    if op == "hidden":
        return Spec((len(rows), dims.hidden), "float")
    if dims.mtp_depth == 0:
        raise _no_mtp(i)
    return Spec((len(rows), _int(i, a, "k", 1, dims.mtp_depth), dims.vocab), "float")


@rule("mtp_logits_at")
def _mtp_logits_at(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    """The MTP chain from one of ``rows``, picked on the device: (k, V)."""
    _ints(i, a, "rows", 0, MAX_DIM, MAX_ROWS)
    if ins[0] != Spec((), "int"):
        raise bad(i, "mtp_logits_at takes a scalar int index into its rows")
    if dims.mtp_depth == 0:
        raise _no_mtp(i)
    return Spec((_int(i, a, "k", 1, dims.mtp_depth), dims.vocab), "float")


@rule("tokens", "iota")
def _length_n(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    return Spec((_int(i, a, "n", 1, MAX_DIM),), "int")


@rule("const")
def _const(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    kind = a.get("dtype")
    if kind not in KINDS:
        raise bad(i, f"const dtype must be one of {KINDS}")
    shape = const_shape(i, a.get("value"))
    if math.prod(shape) > MAX_CONST_ELEMENTS:
        raise bad(i, f"constant larger than {MAX_CONST_ELEMENTS} elements")
    return Spec(shape, kind)


@rule(*CHANNEL_OPS)
def _channel_op(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec | None:
    _, shape, dtype = _channel(i, a)
    spec = Spec(shape, CHANNEL_DTYPES[dtype])
    if op in ("take", "read"):
        return spec
    if ins[0] != spec:
        raise bad(i, f"{op} of {ins[0].shape} {ins[0].kind} into a channel of {shape} {dtype}")
    return None


@rule("fold")
def _fold(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> None:
    spec = ins[0]  # a count, or a path of a tree window: its rows before the first negative entry
    if spec.kind != "int" or not (spec.shape == () or (len(spec.shape) == 1 and spec.shape[0] <= MAX_ROWS)):
        raise bad(i, f"fold takes a scalar int (a count) or a 1-d int of at most {MAX_ROWS} rows (a path)")
    return None


# ---- elementwise, reductions, scans ------------------------------------------------------------------------


@rule(*BINARY_ARITH)
def _binary_arith(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    kind = _numeric(i, *ins)
    return Spec(broadcast(i, ins[0].shape, ins[1].shape), "float" if op == "div" else kind)


@rule(*BINARY_CMP)
def _binary_cmp(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    if op in ("eq", "ne") and (ins[0].kind == "bool") != (ins[1].kind == "bool"):
        raise bad(i, "comparing bool with a number")
    if op not in ("eq", "ne"):
        _numeric(i, *ins)
    return Spec(broadcast(i, ins[0].shape, ins[1].shape), "bool")


@rule(*BINARY_BOOL)
def _binary_bool(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    if any(s.kind != "bool" for s in ins):
        raise bad(i, f"{op} takes bools")
    return Spec(broadcast(i, ins[0].shape, ins[1].shape), "bool")


@rule(*UNARY)
def _unary(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    x = ins[0]
    if op == "not":
        if x.kind != "bool":
            raise bad(i, "not takes a bool")
        return x
    kind = _numeric(i, x)
    return Spec(x.shape, "float" if op in ("exp", "log") else kind)


@rule(*REDUCE)
def _reduce(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    x = ins[0]
    d = _dim(i, a, len(x.shape))
    keep = a.get("keepdim", False)
    if not isinstance(keep, bool):
        raise bad(i, "keepdim must be a bool")
    shape = x.shape[:d] + ((1,) if keep else ()) + x.shape[d + 1 :]
    if op in ("any", "all"):
        if x.kind != "bool":
            raise bad(i, f"{op} takes bools")
        return Spec(shape, "bool")
    if op == "argmax":
        _numeric(i, x)
        return Spec(shape, "int")
    return Spec(shape, "int" if op == "sum" and x.kind == "bool" else _numeric(i, x))


@rule(*SCAN)
def _scan(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    x = ins[0]
    _dim(i, a, len(x.shape))
    if op in ("softmax", "log_softmax"):
        _numeric(i, x)
        return Spec(x.shape, "float")
    return Spec(x.shape, "int" if x.kind == "bool" else _numeric(i, x))


@rule("where")
def _where(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    c, t, f = ins
    if c.kind != "bool":
        raise bad(i, "where's condition must be bool")
    if (t.kind == "bool") != (f.kind == "bool"):
        raise bad(i, "where's branches mix bool and numbers")
    kind = "bool" if t.kind == "bool" else _numeric(i, t, f)
    return Spec(broadcast(i, c.shape, t.shape, f.shape), kind)


@rule("cast")
def _cast(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    kind = a.get("dtype")
    if kind not in KINDS:
        raise bad(i, f"cast dtype must be one of {KINDS}")
    return Spec(ins[0].shape, kind)


# ---- sampling ----------------------------------------------------------------------------------------------


@rule("masked_argmax")
def _masked_argmax(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    x = ins[0]
    if ins[1] != Spec(x.shape, "bool"):
        raise bad(i, "masked_argmax's mask must be bool of the input's shape")
    _numeric(i, x)
    d = _dim(i, a, len(x.shape))
    return Spec(x.shape[:d] + x.shape[d + 1 :], "int")


@rule("sample")
def _sample(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    logits, rng = ins
    if logits.kind != "float" or len(logits.shape) == 0:
        raise bad(i, "sample takes float logits of rank >= 1")
    if rng != Spec((2,), "int"):
        raise bad(i, "an rng state is an int of shape (2,): (seed, counter)")
    _float(i, a, "temperature", 0.0, 1e4, default=1.0)
    _int(i, a, "top_k", 0, MAX_DIM, default=0)
    if _float(i, a, "top_p", 0.0, 1.0, default=1.0) <= 0.0:
        raise bad(i, "top_p must be > 0")
    return Spec(logits.shape[:-1], "int")


@rule("uniform")
def _uniform(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    if ins[0] != Spec((2,), "int"):
        raise bad(i, "an rng state is an int of shape (2,): (seed, counter)")
    return Spec(_shape(i, a), "float")


# ---- indexing and shape ------------------------------------------------------------------------------------


@rule("gather")
def _gather(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    src, idx = ins
    if idx.kind != "int" or len(idx.shape) != len(src.shape):
        raise bad(i, "gather's index must be int with the input's rank")
    d = _dim(i, a, len(src.shape))
    if any(idx.shape[k] > src.shape[k] for k in range(len(src.shape)) if k != d):
        raise bad(i, f"gather index {idx.shape} larger than input {src.shape} off dim {d}")
    return Spec(idx.shape, src.kind)


@rule("scatter")
def _scatter(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    dst, idx, val = ins
    d = _dim(i, a, len(dst.shape))
    if idx.kind != "int" or idx.shape != val.shape or len(idx.shape) != len(dst.shape):
        raise bad(i, "scatter's index must be int, shaped like its values, with the target's rank")
    if any(idx.shape[k] > dst.shape[k] for k in range(len(dst.shape)) if k != d):
        raise bad(i, "scatter index larger than its target off the scatter dim")
    if val.kind != dst.kind:
        raise bad(i, "scatter's values must have the target's dtype")
    return dst


@rule("slice", "index")
def _slice_or_index(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    x = ins[0]
    d = _dim(i, a, len(x.shape))
    n = x.shape[d]
    if op == "index":
        _int(i, a, "index", 0, n - 1)
        return Spec(x.shape[:d] + x.shape[d + 1 :], x.kind)
    start, stop = _int(i, a, "start", 0, n), _int(i, a, "stop", 0, n)
    if stop <= start:
        raise bad(i, f"empty slice [{start}:{stop}]")
    return Spec(x.shape[:d] + (stop - start,) + x.shape[d + 1 :], x.kind)


@rule("concat")
def _concat(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    if not 1 <= len(ins) <= MAX_NODES:
        raise bad(i, "concat takes at least one input")
    x = ins[0]
    d = _dim(i, a, len(x.shape))
    for s in ins:
        if s.kind != x.kind or len(s.shape) != len(x.shape):
            raise bad(i, "concat inputs need one dtype and one rank")
        if s.shape[:d] + s.shape[d + 1 :] != x.shape[:d] + x.shape[d + 1 :]:
            raise bad(i, f"concat shapes {s.shape} and {x.shape} differ off dim {d}")
    return Spec(x.shape[:d] + (sum(s.shape[d] for s in ins),) + x.shape[d + 1 :], x.kind)


@rule("reshape")
def _reshape(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec:
    x = ins[0]
    shape = _shape(i, a)
    if math.prod(shape) != x.numel:
        raise bad(i, f"reshape of {x.shape} to {shape}")
    return Spec(shape, x.kind)
