"""Epilogue programs on the wire: the closed op set, its static shape and dtype rules, limits, and the
canonical encoding whose hash names a program.

A program is a list of nodes ``{"op", "inputs": [node ids], "attrs": {...}}`` in topological order (a node
may only read earlier nodes, so there are no cycles). Every value has a static shape and one of three dtype
kinds: ``float``, ``int``, ``bool``. The SDK's tracer and the engine's validator both run ``infer`` here, so
a program the SDK builds is checked by the same rules the engine enforces. Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from .codec import pack
from .errors import ErrorCode, PieError

KINDS = ("float", "int", "bool")
CHANNEL_DTYPES = {"float32": "float", "float16": "float", "int32": "int", "int64": "int", "bool": "bool"}

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
OTHER = ("where", "cast", "masked_argmax", "sample", "uniform", "gather", "scatter", "slice", "index", "concat",
         "reshape", "mtp_logits_at")
OPS = frozenset(SOURCES + EFFECTS + BINARY_ARITH + BINARY_CMP + BINARY_BOOL + UNARY + REDUCE + SCAN + OTHER)


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


def program_hash(model: str, nodes: list[dict]) -> str:
    """The name of a program: sha256 of its canonical msgpack encoding (attrs keys sorted)."""
    canon = [[n["op"], list(n.get("inputs", [])), sorted(n.get("attrs", {}).items())] for n in nodes]
    return hashlib.sha256(pack([model, canon])).hexdigest()[:32]


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
    """Shape of a nested-list constant; refuses ragged lists and non-numbers."""
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return ()
    if not isinstance(value, list) or not value:
        raise bad(i, "a constant is a number or a non-empty nested list of numbers")
    inner = [const_shape(i, v) for v in value]
    if any(s != inner[0] for s in inner):
        raise bad(i, "a ragged constant")
    return (len(value), *inner[0])


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


ARITY = {**{op: 2 for op in BINARY_ARITH + BINARY_CMP + BINARY_BOOL}, **{op: 1 for op in UNARY + REDUCE + SCAN},
         **{op: 0 for op in SOURCES}, "put": 1, "set": 1, "fold": 1, "where": 3, "cast": 1, "masked_argmax": 2,
         "sample": 2, "uniform": 1, "gather": 2, "scatter": 3, "slice": 1, "index": 1, "reshape": 1,
         "mtp_logits_at": 1}


def infer(i: int, op: str, ins: list[Spec], attrs: dict, dims: ModelDims) -> Spec | None:
    """The output of node ``i`` (None for effects), or INVALID_PROGRAM."""
    if op not in OPS:
        raise bad(i, f"unknown op {op!r}")
    if not isinstance(attrs, dict):
        raise bad(i, "attrs must be a map")
    want = ARITY.get(op)
    if want is not None and len(ins) != want:
        raise bad(i, f"{op} takes {want} inputs, got {len(ins)}")
    out = _infer(i, op, ins, attrs, dims)
    if out is not None:
        if len(out.shape) > MAX_RANK:
            raise bad(i, f"rank {len(out.shape)} exceeds {MAX_RANK}")
        if out.numel > MAX_ELEMENTS:
            raise bad(i, f"{out.numel} elements exceed the limit of {MAX_ELEMENTS}")
    return out


def _infer(i: int, op: str, ins: list[Spec], a: dict, dims: ModelDims) -> Spec | None:
    if op in ("logits", "hidden", "mtp_logits"):
        rows = _ints(i, a, "rows", 0, MAX_DIM, MAX_ROWS)
        if op == "logits":
            return Spec((len(rows), dims.vocab), "float")
        if op == "hidden":
            return Spec((len(rows), dims.hidden), "float")
        if dims.mtp_depth == 0:
            raise PieError(ErrorCode.UNSUPPORTED, f"node {i}: the model has no MTP drafter")
        return Spec((len(rows), _int(i, a, "k", 1, dims.mtp_depth), dims.vocab), "float")
    if op == "mtp_logits_at":  # the MTP chain from one of ``rows``, picked on the device: (k, V)
        _ints(i, a, "rows", 0, MAX_DIM, MAX_ROWS)
        if ins[0] != Spec((), "int"):
            raise bad(i, "mtp_logits_at takes a scalar int index into its rows")
        if dims.mtp_depth == 0:
            raise PieError(ErrorCode.UNSUPPORTED, f"node {i}: the model has no MTP drafter")
        return Spec((_int(i, a, "k", 1, dims.mtp_depth), dims.vocab), "float")
    if op == "tokens":
        return Spec((_int(i, a, "n", 1, MAX_DIM),), "int")
    if op == "const":
        kind = a.get("dtype")
        if kind not in KINDS:
            raise bad(i, f"const dtype must be one of {KINDS}")
        shape = const_shape(i, a.get("value"))
        if math.prod(shape) > MAX_CONST_ELEMENTS:
            raise bad(i, f"constant larger than {MAX_CONST_ELEMENTS} elements")
        return Spec(shape, kind)
    if op == "iota":
        return Spec((_int(i, a, "n", 1, MAX_DIM),), "int")
    if op in ("take", "read", "put", "set"):
        _, shape, dtype = _channel(i, a)
        spec = Spec(shape, CHANNEL_DTYPES[dtype])
        if op in ("take", "read"):
            return spec
        if ins[0] != spec:
            raise bad(i, f"{op} of {ins[0].shape} {ins[0].kind} into a channel of {shape} {dtype}")
        return None
    if op == "fold":
        if ins[0] != Spec((), "int"):
            raise bad(i, "fold takes a scalar int")
        return None
    if op in BINARY_ARITH:
        kind = _numeric(i, *ins)
        return Spec(broadcast(i, ins[0].shape, ins[1].shape), "float" if op == "div" else kind)
    if op in BINARY_CMP:
        if op in ("eq", "ne") and (ins[0].kind == "bool") != (ins[1].kind == "bool"):
            raise bad(i, "comparing bool with a number")
        if op not in ("eq", "ne"):
            _numeric(i, *ins)
        return Spec(broadcast(i, ins[0].shape, ins[1].shape), "bool")
    if op in BINARY_BOOL:
        if any(s.kind != "bool" for s in ins):
            raise bad(i, f"{op} takes bools")
        return Spec(broadcast(i, ins[0].shape, ins[1].shape), "bool")
    x = ins[0] if ins else None
    if op in UNARY:
        if op == "not":
            if x.kind != "bool":
                raise bad(i, "not takes a bool")
            return x
        kind = _numeric(i, x)
        return Spec(x.shape, "float" if op in ("exp", "log") else kind)
    if op in REDUCE:
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
    if op in SCAN:
        _dim(i, a, len(x.shape))
        if op in ("softmax", "log_softmax"):
            _numeric(i, x)
            return Spec(x.shape, "float")
        return Spec(x.shape, "int" if x.kind == "bool" else _numeric(i, x))
    if op == "where":
        c, t, f = ins
        if c.kind != "bool":
            raise bad(i, "where's condition must be bool")
        if (t.kind == "bool") != (f.kind == "bool"):
            raise bad(i, "where's branches mix bool and numbers")
        kind = "bool" if t.kind == "bool" else _numeric(i, t, f)
        return Spec(broadcast(i, c.shape, t.shape, f.shape), kind)
    if op == "cast":
        kind = a.get("dtype")
        if kind not in KINDS:
            raise bad(i, f"cast dtype must be one of {KINDS}")
        return Spec(x.shape, kind)
    if op == "masked_argmax":
        if ins[1] != Spec(x.shape, "bool"):
            raise bad(i, "masked_argmax's mask must be bool of the input's shape")
        _numeric(i, x)
        d = _dim(i, a, len(x.shape))
        return Spec(x.shape[:d] + x.shape[d + 1 :], "int")
    if op == "sample":
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
    if op == "uniform":
        if x != Spec((2,), "int"):
            raise bad(i, "an rng state is an int of shape (2,): (seed, counter)")
        return Spec(_shape(i, a), "float")
    if op == "gather":
        src, idx = ins
        if idx.kind != "int" or len(idx.shape) != len(src.shape):
            raise bad(i, "gather's index must be int with the input's rank")
        d = _dim(i, a, len(src.shape))
        if any(idx.shape[k] > src.shape[k] for k in range(len(src.shape)) if k != d):
            raise bad(i, f"gather index {idx.shape} larger than input {src.shape} off dim {d}")
        return Spec(idx.shape, src.kind)
    if op == "scatter":
        dst, idx, val = ins
        d = _dim(i, a, len(dst.shape))
        if idx.kind != "int" or idx.shape != val.shape or len(idx.shape) != len(dst.shape):
            raise bad(i, "scatter's index must be int, shaped like its values, with the target's rank")
        if any(idx.shape[k] > dst.shape[k] for k in range(len(dst.shape)) if k != d):
            raise bad(i, "scatter index larger than its target off the scatter dim")
        if val.kind != dst.kind:
            raise bad(i, "scatter's values must have the target's dtype")
        return dst
    if op in ("slice", "index"):
        d = _dim(i, a, len(x.shape))
        n = x.shape[d]
        if op == "index":
            _int(i, a, "index", 0, n - 1)
            return Spec(x.shape[:d] + x.shape[d + 1 :], x.kind)
        start, stop = _int(i, a, "start", 0, n), _int(i, a, "stop", 0, n)
        if stop <= start:
            raise bad(i, f"empty slice [{start}:{stop}]")
        return Spec(x.shape[:d] + (stop - start,) + x.shape[d + 1 :], x.kind)
    if op == "concat":
        if not 1 <= len(ins) <= MAX_NODES:
            raise bad(i, "concat takes at least one input")
        d = _dim(i, a, len(x.shape))
        for s in ins:
            if s.kind != x.kind or len(s.shape) != len(x.shape):
                raise bad(i, "concat inputs need one dtype and one rank")
            if s.shape[:d] + s.shape[d + 1 :] != x.shape[:d] + x.shape[d + 1 :]:
                raise bad(i, f"concat shapes {s.shape} and {x.shape} differ off dim {d}")
        return Spec(x.shape[:d] + (sum(s.shape[d] for s in ins),) + x.shape[d + 1 :], x.kind)
    if op == "reshape":
        shape = _shape(i, a)
        if math.prod(shape) != x.numel:
            raise bad(i, f"reshape of {x.shape} to {shape}")
        return Spec(shape, x.kind)
    raise bad(i, f"op {op!r} has no rule")  # pragma: no cover - OPS and the rules above agree


def check_program(nodes: list[dict], dims: ModelDims) -> list[Spec | None]:
    """Validates a whole program; returns each node's spec. Raises INVALID_PROGRAM on the first problem."""
    if not 1 <= len(nodes) <= MAX_NODES:
        raise PieError(ErrorCode.INVALID_PROGRAM, f"a program has 1..{MAX_NODES} nodes")
    specs: list[Spec | None] = []
    folds = 0
    for i, node in enumerate(nodes):
        ins = []
        for j in node.get("inputs", []):
            if not isinstance(j, int) or isinstance(j, bool) or not 0 <= j < i:
                raise bad(i, f"input {j!r} is not an earlier node (programs are acyclic, in order)")
            if specs[j] is None:
                raise bad(i, f"input {j} is an effect ({nodes[j]['op']}), not a value")
            ins.append(specs[j])
        specs.append(infer(i, node.get("op"), ins, node.get("attrs", {}), dims))
        folds += node.get("op") == "fold"
    if folds > 1:
        raise PieError(ErrorCode.INVALID_PROGRAM, "a program folds at most once")
    slots: dict[int, tuple] = {}
    for i, node in enumerate(nodes):
        if node["op"] in ("take", "read", "put", "set"):
            a = node["attrs"]
            key = (tuple(a["shape"]), a["dtype"])
            if slots.setdefault(a["slot"], key) != key:
                raise bad(i, f"slot {a['slot']} used with two channel shapes or dtypes")
    return specs
