"""Checking a program: ``infer`` one node (its arity, its op's rule, the size limits) and ``check_program``
a whole one (acyclic order, at most one fold, one channel shape and dtype per slot); and ``program_hash``,
the name of a program."""

from __future__ import annotations

import hashlib
from typing import cast

from ..codec import pack
from ..errors import ErrorCode, PieError
from .ops import ARITY, CHANNEL_OPS, MAX_ELEMENTS, MAX_NODES, MAX_RANK, PROGRAM_OPS, ModelDims, Spec, bad
from .rules import RULES


def program_hash(model: str, nodes: list[dict]) -> str:
    """The name of a program: sha256 of its canonical msgpack encoding (attrs keys sorted)."""
    canon = [[n["op"], list(n.get("inputs", [])), sorted(n.get("attrs", {}).items())] for n in nodes]
    return hashlib.sha256(pack([model, canon])).hexdigest()[:32]


def infer(i: int, op: str, ins: list[Spec], attrs: dict, dims: ModelDims) -> Spec | None:
    """The output of node ``i`` (None for effects), or INVALID_PROGRAM."""
    if op not in PROGRAM_OPS:
        raise bad(i, f"unknown op {op!r}")
    if not isinstance(attrs, dict):
        raise bad(i, "attrs must be a map")
    want = ARITY.get(op)
    if want is not None and len(ins) != want:
        raise bad(i, f"{op} takes {want} inputs, got {len(ins)}")
    out = RULES[op](i, op, ins, attrs, dims)
    if out is not None:
        if len(out.shape) > MAX_RANK:
            raise bad(i, f"rank {len(out.shape)} exceeds {MAX_RANK}")
        if out.numel > MAX_ELEMENTS:
            raise bad(i, f"{out.numel} elements exceed the limit of {MAX_ELEMENTS}")
    return out


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
        op = cast(str, node.get("op"))  # infer refuses anything that is not an op's name
        specs.append(infer(i, op, ins, node.get("attrs", {}), dims))
        folds += op == "fold"
    if folds > 1:
        raise PieError(ErrorCode.INVALID_PROGRAM, "a program folds at most once")
    slots: dict[int, tuple] = {}
    for i, node in enumerate(nodes):
        if node["op"] in CHANNEL_OPS:
            a = node["attrs"]
            key = (tuple(a["shape"]), a["dtype"])
            if slots.setdefault(a["slot"], key) != key:
                raise bad(i, f"slot {a['slot']} used with two channel shapes or dtypes")
    return specs
