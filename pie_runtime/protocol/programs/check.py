"""Checking a program: ``infer`` one node (its attributes' size and nesting, its arity, its op's rule, the size
limits) and ``check_program`` a whole one (acyclic order, at most one fold, one channel shape and dtype per
slot, and, given a budget, its peak memory: ``peak_bytes``); and ``program_hash``, the name of a program."""

from __future__ import annotations

import hashlib
from typing import cast

from ..codec import pack
from ..errors import ErrorCode, PieError
from .ops import (
    ARITY,
    CHANNEL_OPS,
    MAX_ATTR_DEPTH,
    MAX_ATTR_ITEMS,
    MAX_ATTR_STR,
    MAX_ELEMENTS,
    MAX_NODES,
    MAX_RANK,
    PROGRAM_OPS,
    ModelDims,
    Spec,
    bad,
)
from .rules import RULES


def program_hash(model: str, nodes: list[dict]) -> str:
    """The name of a program: sha256 of its canonical msgpack encoding (attrs keys sorted)."""
    canon = [[n["op"], list(n.get("inputs", [])), sorted(n.get("attrs", {}).items())] for n in nodes]
    return hashlib.sha256(pack([model, canon])).hexdigest()[:32]


def check_attrs(i: int, attrs: dict) -> None:
    """Refuses attributes nested more than ``MAX_ATTR_DEPTH`` lists (or maps) deep, holding more than
    ``MAX_ATTR_ITEMS`` items all told, or a string longer than ``MAX_ATTR_STR``. Walks them level by level,
    without recursion, so that no nesting can exhaust the stack here, in a rule or in ``program_hash``."""
    level, depth, items = list(attrs.values()), 0, 0
    while level:
        items += len(level)
        if items > MAX_ATTR_ITEMS:
            raise bad(i, f"attributes of more than {MAX_ATTR_ITEMS} items")
        deeper: list = []
        for v in level:
            if isinstance(v, (str, bytes)) and len(v) > MAX_ATTR_STR:
                raise bad(i, f"a string attribute longer than {MAX_ATTR_STR}")
            if isinstance(v, (list, tuple)):
                deeper.extend(v)
            elif isinstance(v, dict):
                deeper.extend(v.values())
        if deeper and depth == MAX_ATTR_DEPTH:
            raise bad(i, f"an attribute nested deeper than {MAX_ATTR_DEPTH} levels")
        level, depth = deeper, depth + 1


def infer(i: int, op: str, ins: list[Spec], attrs: dict, dims: ModelDims) -> Spec | None:
    """The output of node ``i`` (None for effects), or INVALID_PROGRAM."""
    if op not in PROGRAM_OPS:
        raise bad(i, f"unknown op {op!r}")
    if not isinstance(attrs, dict):
        raise bad(i, "attrs must be a map")
    check_attrs(i, attrs)
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


def last_uses(nodes: list[dict]) -> list[int]:
    """For each node, the last node that reads its value: itself when none does, ``len(nodes)`` when a put or
    set hands it to a channel (the fire's transaction holds it until the end)."""
    last = list(range(len(nodes)))
    for i, node in enumerate(nodes):
        for j in node.get("inputs", []):
            last[j] = len(nodes) if node["op"] in ("put", "set") else max(last[j], i)
    return last


def peak_bytes(nodes: list[dict], specs: list[Spec | None]) -> int:
    """The most bytes of program values alive at once when the nodes run in order, each value materialised
    at its node (``Spec.nbytes``: float32, int64, bool) and dropped after its last use (``last_uses``), as the
    engine's interpreter does: at node ``i``, the values still to be read plus ``i``'s output. An intrinsic's
    output counts though it may share the engine's readout tensor (an over-estimate); a kernel's own transient
    scratch (e.g. a sample's noise) is not counted, a few times one value at most."""
    last = last_uses(nodes)
    freed = [0] * (len(nodes) + 1)  # node → bytes whose last use it is
    live = peak = 0
    for i, spec in enumerate(specs):
        b = spec.nbytes if spec is not None else 0
        live += b
        peak = max(peak, live)
        freed[last[i]] += b
        live -= freed[i]
    return peak


def check_program(nodes: list[dict], dims: ModelDims, memory: int | None = None) -> list[Spec | None]:
    """Validates a whole program; returns each node's spec. Raises INVALID_PROGRAM on the first problem, and
    LIMIT_EXCEEDED when ``memory`` (a budget in bytes; None: no check) is below its ``peak_bytes``."""
    if not 1 <= len(nodes) <= MAX_NODES:
        raise PieError(ErrorCode.INVALID_PROGRAM, f"a program has 1..{MAX_NODES} nodes")
    specs: list[Spec | None] = []
    folds = 0
    for i, node in enumerate(nodes):
        ins = []
        if len(node.get("inputs", [])) > MAX_NODES:
            raise bad(i, f"more than {MAX_NODES} inputs")
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
    if memory is not None:
        peak = peak_bytes(nodes, specs)
        if peak > memory:
            raise PieError(
                ErrorCode.LIMIT_EXCEEDED,
                f"the program's values peak at {peak} bytes, over the program memory budget of {memory} bytes"
                " (the engine's --program-memory)",
            )
    return specs
