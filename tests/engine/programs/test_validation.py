"""Program validation without an engine: each kind of bad program is refused with INVALID_PROGRAM, fuzzed
programs are either refused with a typed error or run in the interpreter with the shapes the validator
inferred, and the SDK's tracer builds what the engine accepts."""

from __future__ import annotations

import argparse
import weakref
from typing import Any, cast

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferlet.programs import Builder, Program, concat, sample, where
from pie_runtime.cli.engine import add_engine_options
from pie_runtime.engine.channels import TORCH_DTYPES, Channel, Txn
from pie_runtime.engine.programs import run_program, validate
from pie_runtime.engine.programs.interp import KERNELS
from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol.codec import pack, parse_request
from pie_runtime.protocol.programs import (
    ARITY,
    MAX_ATTR_ITEMS,
    MAX_CONST_ELEMENTS,
    MAX_NODES,
    PROGRAM_MEMORY,
    PROGRAM_OPS,
    RULES,
    ModelDims,
    Spec,
    peak_bytes,
)

DIMS = ModelDims(vocab=50, hidden=8, mtp_depth=2)
CPU = torch.device("cpu")


def node(op, inputs=(), **attrs):
    return {"op": op, "inputs": list(inputs), "attrs": attrs}


LOGITS = node("logits", rows=[0, 1, 2])
GOOD = [
    LOGITS,
    node("argmax", [0]),
    node("tokens", n=3),
    node("eq", [1, 2]),
    node("cumprod", [3]),
    node("sum", [4]),
    node("fold", [5]),
]

BAD = {
    "unknown op": [node("launch_missiles")],
    "arity": [LOGITS, node("add", [0])],
    "forward reference": [node("argmax", [1]), LOGITS],
    "self reference (a cycle)": [node("neg", [0])],
    "input is an effect": [LOGITS, node("argmax", [0]), node("fold", [1]), node("neg", [2])],
    "dtype: arithmetic on bool": [LOGITS, node("gt", [0, 0]), node("add", [1, 1])],
    "dtype: where on a float condition": [LOGITS, node("where", [0, 0, 0])],
    "dtype: fold of a float": [LOGITS, node("sum", [0], dim=0), node("sum", [1]), node("fold", [2])],
    "shape: no broadcast": [LOGITS, node("iota", n=7), node("add", [0, 1])],
    "shape: fold of a matrix": [node("iota", n=6), node("reshape", [0], shape=[2, 3]), node("fold", [1])],
    "shape: fold of a path past MAX_ROWS": [node("iota", n=65), node("fold", [0])],
    "shape: put of the wrong cell": [node("iota", n=3), node("put", [0], slot=0, shape=[4], dtype="int32")],
    "shape: slice out of range": [node("iota", n=3), node("slice", [0], dim=0, start=2, stop=9)],
    "shape: reshape numel": [node("iota", n=6), node("reshape", [0], shape=[4])],
    "shape: gather rank": [LOGITS, node("iota", n=3), node("gather", [0, 1], dim=1)],
    "dim out of range": [LOGITS, node("argmax", [0], dim=5)],
    "size: too many elements": [
        node("iota", n=1 << 20),
        node("iota", n=64),
        node("reshape", [1], shape=[64, 1]),
        node("mul", [0, 2]),
    ],
    "size: too many rows": [node("logits", rows=list(range(65)))],
    "size: too many nodes": [node("iota", n=1)] * (MAX_NODES + 1),
    "size: huge constant": [node("const", value=[0] * 5000, dtype="int")],
    "attr: missing": [node("iota")],
    "attr: wrong type": [node("iota", n="3")],
    "attr: bad channel dtype": [node("take", slot=0, shape=[1], dtype="complex64")],
    "attr: ragged constant": [node("const", value=[[1, 2], [3]], dtype="int")],
    "two folds": GOOD + [node("fold", [5])],
    "one slot, two shapes": [
        node("take", slot=0, shape=[1], dtype="int32"),
        node("take", slot=0, shape=[2], dtype="int32"),
    ],
    "slots with a gap": [node("take", slot=1, shape=[1], dtype="int32")],
    "mtp past its depth": [node("mtp_logits", rows=[0], k=3)],
    "mtp at a vector index": [node("iota", n=2), node("mtp_logits_at", [0], rows=[0, 1], k=1)],
    "mtp at a float index": [node("const", value=1.0, dtype="float"), node("mtp_logits_at", [0], rows=[0], k=1)],
}


def test_mtp_logits_at_reads_one_row_picked_on_the_device():
    nodes = [node("const", value=1, dtype="int"), node("mtp_logits_at", [0], rows=[0, 1, 2], k=2), node("argmax", [1])]
    prog = validate("m", nodes, DIMS)
    assert prog.specs[1].shape == (2, DIMS.vocab) and prog.rows == {0, 1, 2}
    with pytest.raises(PieError) as e:
        validate("m", nodes, ModelDims(DIMS.vocab, DIMS.hidden, 0))
    assert e.value.code == ErrorCode.UNSUPPORTED
    bad = [node("const", value=3, dtype="int"), *nodes[1:]]
    with pytest.raises(PieError) as e:
        run(validate("m", bad, DIMS))
    assert e.value.code == ErrorCode.PROGRAM_FAILED


def test_a_good_program_validates():
    prog = validate("m", GOOD, DIMS)
    assert prog.folds and prog.window == 3 and prog.rows == {0, 1, 2}
    assert validate("m", GOOD, DIMS).hash == prog.hash != validate("other", GOOD, DIMS).hash


@pytest.mark.parametrize("why", sorted(BAD))
def test_each_kind_of_bad_program_is_refused(why):
    with pytest.raises(PieError) as e:
        validate("m", BAD[why], DIMS)
    assert e.value.code == ErrorCode.INVALID_PROGRAM, why


class FakeFire:
    """Intrinsics with random values of the right shapes."""

    def __init__(self, window: int):
        self.g = torch.Generator().manual_seed(0)
        self.window = window

    def logits(self, rows):
        return torch.randn(len(rows), DIMS.vocab, generator=self.g)

    def hidden(self, rows):
        return torch.randn(len(rows), DIMS.hidden, generator=self.g)

    def mtp_logits(self, rows, k):
        return torch.randn(len(rows), k, DIMS.vocab, generator=self.g)

    def mtp_logits_at(self, rows, k, index):
        return torch.randn(k, DIMS.vocab, generator=self.g)

    def tokens(self):
        return torch.randint(0, DIMS.vocab, (self.window,), generator=self.g)


def run(prog, window=3, cells=2):
    chans = [Channel(i, b"c", "m", shape, dtype, 8, CPU) for i, (shape, dtype) in sorted(prog.slots.items())]
    for ch in chans:
        for _ in range(cells):
            ch.cells.append(torch.zeros(ch.shape, dtype=torch.int64).to(TORCH_DTYPES[ch.dtype]))
    txn = Txn(chans)
    fold = run_program(prog, FakeFire(window), txn, CPU)
    return fold, txn


def seeded_window(window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the window's rows and its tokens as :class:`FakeFire` draws them, in the order a program
    reads them (its logits node first)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(window, DIMS.vocab, generator=g)
    return logits, torch.randint(0, DIMS.vocab, (window,), generator=g)


def accepted_prefix(target: torch.Tensor, drafts: torch.Tensor) -> int:
    return int((target == drafts).int().cumprod(0).sum())


def test_the_good_program_runs():
    """GOOD folds the rows whose argmax equals the window's token, up to the first that does not."""
    logits, tokens = seeded_window(3)
    fold, _ = run(validate("m", GOOD, DIMS))
    assert fold == accepted_prefix(logits.argmax(-1), tokens) == 0  # seeded: argmax 45, 9, 22 vs tokens 6, 44, 41


class AgreeingFire(FakeFire):
    """FakeFire whose tokens equal its logits' argmax on every row but the last."""

    def logits(self, rows):
        self.drawn = super().logits(rows)
        return self.drawn

    def tokens(self):
        t = self.drawn.argmax(-1)
        t[-1] = (t[-1] + 1) % DIMS.vocab
        return t


def test_the_good_program_folds_the_agreeing_rows():
    chans: list[Channel] = []
    fold = run_program(validate("m", GOOD, DIMS), AgreeingFire(3), Txn(chans), CPU)
    assert fold == 2


# ---- fuzzing: the validator never crashes, and what it accepts runs with the shapes it inferred ------------

_attr_values = st.one_of(
    st.integers(-3, 70),
    st.floats(-2, 2, allow_nan=False),
    st.booleans(),
    st.sampled_from(["int", "float", "bool", "int32", "float32", "x"]),
    st.lists(st.integers(-1, 5), max_size=4),
)
_attr_names = st.sampled_from(
    [
        "dim",
        "n",
        "rows",
        "k",
        "value",
        "dtype",
        "slot",
        "shape",
        "start",
        "stop",
        "index",
        "keepdim",
        "temperature",
        "top_k",
        "top_p",
    ]
)


_SOURCES = [
    lambda d: node("logits", rows=d(st.lists(st.integers(0, 3), min_size=1, max_size=3))),
    lambda d: node("hidden", rows=[0]),
    lambda d: node("mtp_logits", rows=[0, 1], k=d(st.integers(1, 3))),
    lambda d: node("tokens", n=3),
    lambda d: node("iota", n=d(st.integers(1, 4))),
    lambda d: node(
        "const",
        value=d(st.sampled_from([1, 2.5, True, [1, 2, 3], [[0.5], [1.5]]])),
        dtype=d(st.sampled_from(["int", "float", "bool"])),
    ),
    lambda d: node(d(st.sampled_from(["take", "read"])), slot=0, shape=[3], dtype="int32"),
]
_ATTRS = {
    "dim": st.integers(-2, 1),
    "keepdim": st.booleans(),
    "start": st.integers(0, 3),
    "stop": st.integers(1, 4),
    "index": st.integers(0, 3),
    "shape": st.sampled_from([[3], [1, 3], [3, 1], [], [50], [2, 2]]),
    "dtype": st.sampled_from(["int", "float", "bool", "int32"]),
    "temperature": st.sampled_from([0.0, 0.8]),
    "top_k": st.integers(0, 5),
    "top_p": st.sampled_from([0.5, 1.0]),
    "slot": st.just(0),
}


@st.composite
def programs(draw):
    """Mostly plausible programs (ops fed by earlier values, attributes of the right names and types),
    so that the fuzz reaches the interpreter as well as the validator's refusals."""
    nodes = [draw(st.sampled_from(_SOURCES))(draw)]
    for i in range(1, draw(st.integers(1, 12))):
        op = draw(st.sampled_from(sorted(PROGRAM_OPS) + ["bogus"]))
        if op in ("logits", "hidden", "mtp_logits", "tokens", "iota", "const", "take", "read"):
            nodes.append(draw(st.sampled_from(_SOURCES))(draw))
            continue
        arity = {"where": 3, "scatter": 3, "concat": draw(st.integers(1, 3))}.get(op)
        if arity is None:
            arity = (
                2
                if op
                in (
                    "add",
                    "sub",
                    "mul",
                    "div",
                    "floordiv",
                    "mod",
                    "maximum",
                    "minimum",
                    "eq",
                    "ne",
                    "lt",
                    "le",
                    "gt",
                    "ge",
                    "and",
                    "or",
                    "xor",
                    "masked_argmax",
                    "sample",
                    "gather",
                )
                else 1
            )
        arity = draw(st.sampled_from([arity, arity, arity, arity - 1, arity + 1]))
        inputs = [draw(st.integers(-1, i)) for _ in range(max(arity, 0))]
        attrs = {k: draw(v) for k, v in _ATTRS.items() if draw(st.booleans())}
        if op in ("put", "set"):
            attrs.update(slot=0, shape=[3], dtype="int32")
        nodes.append(node(op, inputs, **attrs))
    return nodes


def _check_runs(prog):
    try:
        values_ok = run(prog)
    except PieError as e:  # data-dependent failures are typed too
        assert e.code in (ErrorCode.PROGRAM_FAILED, ErrorCode.CHANNEL_EMPTY, ErrorCode.INVALID_ARGUMENT), e
        return
    assert values_ok is not None


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_fuzzed_programs_are_refused_with_a_typed_error_or_run(nodes):
    try:
        prog = validate("m", nodes, DIMS)
    except PieError as e:
        assert e.code in (ErrorCode.INVALID_PROGRAM, ErrorCode.UNSUPPORTED)
        return
    _check_runs(prog)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(GOOD) - 1), _attr_names, _attr_values, st.lists(st.integers(-1, 8), max_size=3))
def test_mutations_of_a_good_program_are_refused_or_run(i, name, value, inputs):
    nodes = [dict(n, attrs=dict(n["attrs"])) for n in GOOD]
    nodes[i]["attrs"][name] = value
    if inputs:
        nodes[i]["inputs"] = inputs
    try:
        prog = validate("m", nodes, DIMS)
    except PieError as e:
        assert e.code == ErrorCode.INVALID_PROGRAM
        return
    _check_runs(prog)


# ---- the SDK's tracer ----------------------------------------------------------------------------------


class FakeChannel:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


class FakeModel:
    name, vocab_size, hidden_size, mtp_depth = "m", DIMS.vocab, DIMS.hidden, DIMS.mtp_depth


def test_traced_verify_program_validates_and_accepts_the_agreeing_prefix():
    window: Any = FakeChannel((4,), "int32")
    out: Any = FakeChannel((4,), "int32")
    b = Builder(DIMS)
    target = b.logits(range(4)).argmax()
    drafts = b.tokens(4)[1:]
    n = (drafts == target[:3]).int().cumprod().sum()
    b.fold(n + 1)
    b.put(out, where(b.iota(4) <= n, target, -1).cast("int"))
    b.put(window, concat([target[:1], drafts]))
    rng = b.const([7, 0])
    sample(b.logits([0]), rng, temperature=0.7, top_k=5)
    prog = validate("m", b.nodes, DIMS)
    assert prog.hash == Program(cast(Any, FakeModel()), b.nodes, b.channels).hash
    assert [c for c in b.channels] == [out, window]
    fold, txn = run(prog, window=4)
    logits, tokens = seeded_window(4)
    target = logits.argmax(-1)
    n = accepted_prefix(target[:3], tokens[1:])
    assert fold == n + 1 == 1  # seeded: no draft agrees
    assert len(txn.puts[0]) == 1 and txn.puts[0][0].tolist() == [int(target[0]), -1, -1, -1]
    assert txn.puts[1][0].tolist() == [int(target[0]), *tokens[1:].tolist()]


def test_tracer_refuses_at_the_offending_line():
    b = Builder(DIMS)
    x = b.logits([0, 1])
    with pytest.raises(PieError) as e:
        _ = x + b.iota(3)
    assert e.value.code == ErrorCode.INVALID_PROGRAM
    with pytest.raises(TypeError):
        bool(x.argmax() == 3)
    assert np.array_equal(run(validate("m", b.nodes, DIMS))[0] is None, True)


def test_each_op_has_one_rule_and_one_kernel_or_intrinsic():
    """The op set, its rules, its arities and the interpreter's kernels name the same ops."""
    intrinsics = {
        "logits",
        "hidden",
        "mtp_logits",
        "mtp_logits_at",
        "tokens",
        "const",
        "iota",
        "take",
        "read",
        "put",
        "set",
        "fold",
    }  # run_program runs these itself
    assert set(RULES) == PROGRAM_OPS
    assert set(KERNELS) | intrinsics == PROGRAM_OPS and not set(KERNELS) & intrinsics
    assert set(ARITY) <= PROGRAM_OPS and PROGRAM_OPS - set(ARITY) == {"concat"}  # concat takes 1..MAX_NODES


# ---- hardening: nesting, size and memory limits checked at validation; values freed after a run ---------


def _nested(depth: int, leaf: Any = 1) -> Any:
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize("depth", [5, 600, 1000, 100_000])
def test_a_deep_const_is_refused_without_recursion(depth):
    for attr in ("value", "other"):  # the const's value, and an attribute no rule reads (it is hashed too)
        nodes = [node("const", dtype="int", **{"value": 1, attr: _nested(depth)})]
        with pytest.raises(PieError) as e:
            validate("m", nodes, DIMS)
        assert e.value.code == ErrorCode.INVALID_PROGRAM and "nested deeper than 4" in e.value.message


def _register_bytes(depth: int) -> bytes:
    """A program_register whose const nests ``depth`` lists deep, encoded by hand: msgpack's own packer stops
    near 1,000 levels."""
    msg = pack({"id": 7, "op": "program_register", "model": "m", "nodes": [node("const", value="@@", dtype="int")]})
    return msg.replace(pack("@@"), b"\x91" * depth + b"\x01")


@pytest.mark.parametrize("depth", [600, 1000, 100_000])
def test_a_deep_const_on_the_wire_gets_a_typed_refusal(depth):
    try:
        _, req = parse_request(_register_bytes(depth))
        validate("m", [n.model_dump() for n in req.nodes], DIMS)
    except PieError as e:
        assert e.code in (ErrorCode.BAD_MESSAGE, ErrorCode.INVALID_PROGRAM) and e.request_id in (7, None)
        assert "deep" in e.message
    else:
        raise AssertionError("accepted")


def test_consts_up_to_rank_four_validate_and_the_walk_still_refuses_ragged_and_huge():
    prog = validate("m", [node("const", value=_nested(3, [1, 2]), dtype="int")], DIMS)
    assert prog.specs[0] == Spec((1, 1, 1, 2), "int")
    for value in ([[1], [[2]]], [[1, 2], 3], [[]], [[[[[1]]]]], _nested(2, [0] * (MAX_CONST_ELEMENTS + 1)), "x"):
        with pytest.raises(PieError) as e:
            validate("m", [node("const", value=value, dtype="int")], DIMS)
        assert e.value.code == ErrorCode.INVALID_PROGRAM, value
    for attrs in ({"big": list(range(MAX_ATTR_ITEMS + 1))}, {"s": "x" * 1000}, {"deep": {"a": _nested(5)}}):
        with pytest.raises(PieError) as e:
            validate("m", [node("iota", n=3, **attrs)], DIMS)
        assert e.value.code == ErrorCode.INVALID_PROGRAM, attrs


def _wide(n: int) -> list[dict]:
    """A [4096, 4096] uniform (64 MiB of float32) and ``n`` exps of it, all alive until a chain of adds."""
    adds = [node("add", [2, 3])] + [node("add", [n + 1 + k, 3 + k]) for k in range(1, n - 1)]
    return [
        node("const", value=[7, 0], dtype="int"),
        node("uniform", [0], shape=[4096, 4096]),
        *[node("exp", [1]) for _ in range(n)],
        *adds,
        node("sum", [2 * n]),
        node("sum", [2 * n + 1]),
    ]


def test_a_program_over_the_memory_budget_is_refused_at_validation():
    prog = validate("m", _wide(2), DIMS)
    assert peak_bytes(_wide(2), prog.specs) == 3 * (64 << 20)  # the uniform and two exps, or two exps and a sum
    with pytest.raises(PieError) as e:
        validate("m", _wide(4), DIMS)  # four exps and their first add: 320 MiB
    assert e.value.code == ErrorCode.LIMIT_EXCEEDED and str(PROGRAM_MEMORY) in e.value.message
    assert "--program-memory" in e.value.message
    specs = validate("m", _wide(4), DIMS, memory=1 << 40).specs
    peak = peak_bytes(_wide(4), specs)
    assert peak == 5 * (64 << 20)
    validate("m", _wide(4), DIMS, memory=peak)  # just at the budget
    with pytest.raises(PieError) as e:
        validate("m", _wide(4), DIMS, memory=peak - 1)
    assert e.value.code == ErrorCode.LIMIT_EXCEEDED


def test_the_issue_s_500_node_program_is_refused_and_a_long_chain_is_not():
    """16M-element values all alive until a chain of adds reads them: ~16 GiB if run. A chain of the same
    length holds two values at a time (each dropped after its last use) and fits."""
    many = _wide(250)
    assert len(many) <= MAX_NODES
    with pytest.raises(PieError) as e:
        validate("m", many, DIMS)
    assert e.value.code == ErrorCode.LIMIT_EXCEEDED
    chain = [node("iota", n=1 << 20)] + [node("exp", [i]) for i in range(511)]
    prog = validate("m", chain, DIMS)
    assert peak_bytes(chain, prog.specs) == (8 << 20) + (4 << 20)


def test_the_engine_flag_sets_the_budget():
    p = argparse.ArgumentParser()
    add_engine_options(p)
    assert p.parse_args([]).program_memory << 20 == PROGRAM_MEMORY
    assert p.parse_args(["--program-memory", "1024"]).program_memory == 1024


class _Watch:
    """Wraps the interpreter's kernels to keep a weak reference to every value they make."""

    def __init__(self, monkeypatch):
        self.refs: list[weakref.ref] = []
        for op, fn in list(KERNELS.items()):
            monkeypatch.setitem(KERNELS, op, self._wrap(fn))

    def _wrap(self, fn):
        def kernel(*args):
            out = fn(*args)
            self.refs.append(weakref.ref(out))
            return out

        return kernel

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)


def test_a_failed_epilogue_leaves_no_value_alive(monkeypatch):
    """The issue's leak: a big uniform and exps ending in a failing gather. Nothing may hold them after the
    error, not even the error's traceback or chained cause."""
    watch = _Watch(monkeypatch)
    nodes = [
        node("const", value=[7, 0], dtype="int"),
        node("uniform", [0], shape=[256, 256]),
        *[node("exp", [i + 1]) for i in range(5)],
        node("const", value=[[1000]], dtype="int"),
        node("gather", [6, 7], dim=1),
        node("sum", [8]),
        node("sum", [9]),
    ]
    with pytest.raises(PieError) as e:
        run(validate("m", nodes, DIMS))
    assert e.value.code == ErrorCode.PROGRAM_FAILED and "node 8 (gather)" in e.value.message
    assert e.value.__context__ is None and e.value.__cause__ is None
    assert len(watch.refs) == 6 and watch.alive() == 0


def test_values_are_dropped_after_their_last_use_and_at_the_end(monkeypatch):
    watch = _Watch(monkeypatch)
    seen: list[int] = []
    exp = KERNELS["exp"]

    def spy(x, a):
        seen.append(watch.alive())  # values alive as this node runs, besides its input
        return exp(x, a)

    monkeypatch.setitem(KERNELS, "exp", spy)
    nodes = [
        node("const", value=[7, 0], dtype="int"),
        node("uniform", [0], shape=[64, 64]),
        node("slice", [1], dim=0, start=0, stop=1),  # a copy: the uniform goes after this node
        *[node("exp", [i + 2]) for i in range(4)],
        node("sum", [6]),
        node("sum", [7]),
    ]
    fold, _ = run(validate("m", nodes, DIMS))
    assert fold is None and seen == [1, 1, 1, 1]  # only the input: the uniform and older exps are gone
    assert watch.alive() == 0


def test_any_exception_in_a_kernel_fails_the_fire(monkeypatch):
    def boom(x, a):
        raise MemoryError("out of memory")

    monkeypatch.setitem(KERNELS, "exp", boom)
    with pytest.raises(PieError) as e:
        run(validate("m", [node("iota", n=3), node("exp", [0])], DIMS))
    assert e.value.code == ErrorCode.PROGRAM_FAILED and "node 1 (exp): out of memory" in e.value.message
