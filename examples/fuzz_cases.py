"""The hostile messages of the engine fuzzer (``examples/fuzz_engine.py``): a raw DEALER connection that
speaks the wire protocol directly (docs/architecture.md, "The wire"), the handles a case may abuse, and one
seeded case per kind (``KINDS``): random bytes, non-map msgpack, wrong types, huge and negative numbers,
foreign handles, lying arrays, channel extremes, deep and huge programs, program memory, sampler extremes,
oversized readouts, channel takes that cannot be served, overflowing speculation reports, floods, hellos and
oversized messages. A case returns its messages (examples/fuzz_conn.py); the runner sends them and checks
every answer.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pie_runtime.protocol.messages import PROTOCOL_VERSION

if not __package__:  # imported by a script in examples/: the repository root, so that `examples.` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.fuzz_conn import _NO_ID, Conn, Handles, Msg, pack

WRONG_VALUES: list[Any] = [
    "x",
    "",
    [],
    [1, 2],
    {},
    {"a": 1},
    None,
    True,
    1.5,
    b"\x00",
    2**63,
    -1,
    2**64 - 1,
    -(2**63),
    math.nan,
    math.inf,
    -math.inf,
]
HUGE_INTS: list[Any] = [2**63, 2**63 - 1, -1, 2**64 - 1, -(2**63), 2**31, 2**32, math.nan, math.inf, 1e308, -0.0]


def templates(h: Handles, rng: random.Random) -> list[dict]:
    """One valid-looking request per op, on the fuzzer's own handles (ids assigned at build)."""
    ws, ch = rng.choice(h.ws), rng.choice(h.channels)
    put = {"dtype": "int32", "shape": [1], "data": b"\x05\x00\x00\x00"}
    return [
        {"op": "hello", "version": PROTOCOL_VERSION, "client": "fuzz"},
        {"op": "tokenizer", "model": h.model},
        {"op": "ws_open", "model": h.model},
        {"op": "ws_fork", "ws": ws},
        {"op": "ws_release", "ws": rng.choice(h.ws + [h.foreign_ws])},
        {"op": "ws_fold", "ws": ws, "n": 0},
        {"op": "ws_truncate", "ws": ws, "n": 0},
        {"op": "fire", "ws": ws, "tokens": [1], "readouts": [{"rows": [0], "kind": "argmax"}], "fold": 0},
        {"op": "stats"},
        {"op": "ping"},
        {"op": "program_register", "model": h.model, "nodes": [{"op": "logits", "attrs": {"rows": [0]}}]},
        {"op": "channel_open", "model": h.model, "shape": [1], "dtype": "int32", "capacity": 1},
        {"op": "channel_put", "channel": ch, "value": put},
        {"op": "channel_set", "channel": ch, "value": put},
        {"op": "channel_take", "channel": ch, "max": 1, "min": 1},
        {"op": "channel_read", "channel": ch},
        {"op": "spec_report", "model": h.model, "inferlet": "fuzz", "rounds": 1, "proposed": 1, "accepted": 1,
         "rounds_with_rejection": 0},
    ]  # fmt: skip


def _with_id(obj: dict) -> dict:
    return {"id": _NO_ID, **obj}


def case_random_bytes(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    n = rng.choice([0, 1, 2, 7, 64, 1000])
    data = rng.randbytes(n)
    if rng.random() < 0.3:  # a truncated valid message
        full = pack({"id": c.new_id(), "op": "ping"})
        data = full[: rng.randrange(len(full))]
    return [Msg("random_bytes", data, f"<{len(data)} random bytes> {data[:12]!r}")]


def case_non_map(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    obj = rng.choice([[1, "ping"], 42, "ping", None, b"\x01\x02", 1.5, [{"id": 1, "op": "ping"}], True])
    return [c.build("non_map", obj)]


def case_wrong_types(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    t = rng.choice(templates(h, rng))
    obj = _with_id(t)
    keys = [k for k in obj if k != "op"] + ["op", "extra_field"]
    k = rng.choice(keys)
    obj[k] = rng.choice(WRONG_VALUES + ["not_an_op", "fire "]) if k == "op" else rng.choice(WRONG_VALUES)
    return [c.build("wrong_types", obj, op=t["op"])]


def case_huge_numbers(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    t = rng.choice([t for t in templates(h, rng) if any(isinstance(v, int) for v in t.values())])
    obj = _with_id(t)
    k = rng.choice([k for k, v in t.items() if isinstance(v, int) and not isinstance(v, bool)])
    obj[k] = rng.choice(HUGE_INTS)
    if obj["op"] == "fire" and rng.random() < 0.5:  # numbers inside a fire
        where = rng.choice(["tokens", "positions", "rows", "settle", "seed"])
        v = rng.choice(HUGE_INTS)
        obj = _with_id({"op": "fire", "ws": rng.choice(h.ws), "tokens": [1], "fold": 0})
        if where == "tokens":
            obj["tokens"] = [v]
        elif where == "positions":
            obj["positions"] = [v]
        elif where == "rows":
            obj["readouts"] = [{"rows": [v], "kind": "argmax"}]
        elif where == "settle":
            obj["settle"] = v
        else:
            obj["readouts"] = [{"rows": [0], "kind": "sample", "seed": v}]
    return [c.build("huge_numbers", obj)]


def case_foreign_handles(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    ws = rng.choice([h.foreign_ws, 0, -1, 2**63 - 1, 2**64 - 1, 987654321])
    ch = rng.choice([h.foreign_channel, 0, -1, 2**63 - 1, 2**64 - 1, 987654321])
    put = {"dtype": "int32", "shape": [1], "data": b"\x07\x00\x00\x00"}
    obj = rng.choice(
        [
            {"op": "ws_fork", "ws": ws},
            {"op": "ws_release", "ws": ws},
            {"op": "ws_fold", "ws": ws, "n": 0},
            {"op": "ws_truncate", "ws": ws, "n": 0},
            {"op": "fire", "ws": ws, "tokens": [1], "fold": 0},
            {"op": "fire", "ws": rng.choice(h.ws), "tokens_from": ch, "fold": 0},
            {"op": "fire", "ws": rng.choice(h.ws), "tokens": [1], "program": h.program, "bindings": [ch], "fold": 0},
            {"op": "fire", "ws": rng.choice(h.ws), "tokens": [1], "program": "0" * 64, "fold": 0},
            {"op": "channel_put", "channel": ch, "value": put},
            {"op": "channel_set", "channel": ch, "value": put},
            {"op": "channel_take", "channel": ch},
            {"op": "channel_read", "channel": ch},
            {"op": "channel_close", "channel": ch},
        ]
    )
    return [c.build("foreign_handles", _with_id(obj))]


def lying_array(rng: random.Random) -> dict:
    return rng.choice(
        [
            {"dtype": "int32", "shape": [1], "data": b"\x00\x00"},  # data shorter than the shape
            {"dtype": "int32", "shape": [1], "data": b"\x00" * 4096},  # longer
            {"dtype": "int32", "shape": [-1], "data": b"\x00" * 4},  # a negative dim
            {"dtype": "int32", "shape": [-4, -1], "data": b"\x00" * 16},
            {"dtype": "int32", "shape": [2**62], "data": b"\x00" * 4},
            {"dtype": "int32", "shape": [2**64 - 1], "data": b""},
            {"dtype": "float16", "shape": [2], "data": b"\x00" * 4},  # another dtype, same bytes
            {"dtype": "uint8", "shape": [4], "data": b"\x05\x00\x00\x00"},
            {"dtype": "float32", "shape": [1], "data": b"\x00\x00\xc0\x7f"},  # NaN
            {"dtype": "object", "shape": [1], "data": b"\x00" * 8},
            {"dtype": "float64", "shape": [1], "data": b"\x00" * 8},
            {"dtype": "int32", "shape": [], "data": b"\x05\x00\x00\x00"},
            {"dtype": "int32", "shape": [1, 1, 1, 1, 1, 1, 1, 1], "data": b"\x05\x00\x00\x00"},
            {"dtype": "int32", "shape": [1], "data": "text"},
            {"dtype": "int32", "shape": "1", "data": b"\x05\x00\x00\x00"},
            {"dtype": "int32", "data": b"\x05\x00\x00\x00"},
        ]
    )


def case_lying_arrays(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    arr = lying_array(rng)
    ch = rng.choice(h.channels)
    if rng.random() < 0.6:
        obj = {"op": rng.choice(["channel_put", "channel_set"]), "channel": ch, "value": arr}
    else:  # as a readout mask
        obj = {
            "op": "fire",
            "ws": rng.choice(h.ws),
            "tokens": [1],
            "readouts": [{"rows": [0], "kind": rng.choice(["argmax", "sample", "distribution"]), "mask": arr}],
            "fold": 0,
        }
    return [c.build("lying_arrays", _with_id(obj))]


def case_channel_open_extremes(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    shape = rng.choice([[2**62], [-1], [0], [2**31, 2**31], [1 << 20, 1 << 20, 1 << 20, 1 << 20], [1] * 5, []])
    cap = rng.choice([1, 4096, 4097, 0, -1, 2**63])
    dtype = rng.choice(["int32", "float32", "bool", "float64", "object"])
    return [c.build("channel_open", _with_id({"op": "channel_open", "shape": shape, "dtype": dtype, "capacity": cap}))]


def deep_program(rid: int, model: str, depth: int, in_rows: bool) -> bytes:
    """``program_register`` of one node whose ``value`` (or ``rows``) attribute is a list nested ``depth``
    levels deep, built by hand: msgpack's packer stops at 512 levels, its unpacker at 1024."""
    deep = b"\x91" * depth + b"\x01"
    if in_rows:
        attrs = b"\x81" + pack("rows") + deep
        op = "logits"
    else:
        attrs = b"\x82" + pack("dtype") + pack("int") + pack("value") + deep
        op = "const"
    node = b"\x82" + pack("op") + pack(op) + pack("attrs") + attrs
    head = {"id": rid, "op": "program_register", "model": model}
    return b"\x84" + b"".join(pack(k) + pack(v) for k, v in head.items()) + pack("nodes") + b"\x91" + node


def case_deep_program(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    depth = rng.choice([600, 1000, 1023, 5000])
    in_rows = rng.random() < 0.3
    payload = deep_program(c.new_id(), h.model, depth, in_rows)
    where = "rows" if in_rows else "const value"
    return [Msg("deep_program", payload, f"program_register, {where} nested {depth} levels", "program_register")]


def case_huge_program(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    choice = rng.randrange(4)
    if choice == 0:  # 10,000 nodes
        nodes = [{"op": "const", "attrs": {"dtype": "int", "value": 1}}] + [
            {"op": "add", "inputs": [i, i]} for i in range(9999)
        ]
    elif choice == 1:  # huge shapes
        shape = rng.choice([[1 << 20] * 4, [2**62], [2**31, 2**31], [-1], [0], [4096, 4096, 4096]])
        nodes = [
            {"op": "const", "attrs": {"dtype": "int", "value": [1, 2]}},
            {"op": "uniform", "inputs": [0], "attrs": {"shape": shape}},
        ]
    elif choice == 2:  # a const of huge size or of huge numbers
        value = rng.choice([[0] * 100_000, [2**64 - 1], [math.nan, math.inf], [[1, 2], [3]], []])
        nodes = [{"op": "const", "attrs": {"dtype": rng.choice(["int", "float", "nope"]), "value": value}}]
    else:  # bad graphs: forward and self references, unknown ops, wrong arity
        nodes = rng.choice(
            [
                [{"op": "add", "inputs": [0, 0]}],
                [{"op": "argmax", "inputs": [5]}],
                [{"op": "argmax", "inputs": [-1]}],
                [{"op": "eval", "attrs": {"code": "__import__('os')"}}],
                [{"op": "logits", "attrs": {"rows": [0]}}, {"op": "add", "inputs": [0]}],
                [{"op": "logits", "attrs": {"rows": [2**63]}}],
                [{"op": "logits", "attrs": {"rows": list(range(10_000))}}],
            ]
        )
    return [c.build("huge_program", _with_id({"op": "program_register", "model": h.model, "nodes": nodes}))]


def case_program_memory(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    """A program of large intermediates that fails at run time: its memory must be freed."""
    side = rng.choice([1024, 2048, 4096])
    nodes: list[dict] = [
        {"op": "const", "attrs": {"dtype": "int", "value": [7, 0]}},
        {"op": "uniform", "inputs": [0], "attrs": {"shape": [side, side]}},
    ]
    for _ in range(rng.choice([4, 8])):
        nodes.append({"op": "exp", "inputs": [len(nodes) - 1]})
    nodes.append({"op": "const", "attrs": {"dtype": "int", "value": [[2**40]]}})  # an index far out of range
    nodes.append({"op": "gather", "inputs": [len(nodes) - 2, len(nodes) - 1], "attrs": {"dim": 1}})
    reg = c.build("program_memory", {"id": c.new_id(), "op": "program_register", "model": h.model, "nodes": nodes})
    # the program's hash is unknown until registered: the fire names it by a canonical guess the engine refuses
    # if registration failed; the runner re-fires with the real hash (see run_case)
    return [reg]


def case_sampler_extremes(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    words = (h.vocab + 31) // 32
    readout: dict[str, Any] = {"rows": [0], "kind": rng.choice(["sample", "distribution"]), "seed": 1}
    which = rng.randrange(8)
    if which == 0:
        readout["temperature"] = rng.choice([1e-300, 5e-324, 1e-45, 1e300, math.inf, math.nan, -0.0, 0.0])
    elif which == 1:
        readout["top_p"] = rng.choice([1e-300, 5e-324, 1e-45, math.nan, 1.0 + 1e-16])
    elif which == 2:
        readout["top_k"] = rng.choice([2**63 - 1, 2**64 - 1, h.vocab + 1, 1, 2**31])
    elif which == 3:
        readout["mask"] = {"dtype": "int32", "shape": [1, words], "data": b"\x00" * (4 * words)}
    elif which == 4:  # a mask that allows one token past the vocabulary only
        data = bytearray(4 * words)
        data[-1] = 0x80
        readout["mask"] = {"dtype": "uint32", "shape": [1, words], "data": bytes(data)}
    elif which == 5:
        readout["min_p"] = 0.5  # no such field
    elif which == 6:
        readout.update(temperature=1e-300, top_p=1e-300, top_k=1)
    else:
        readout["seed"] = rng.choice([2**64 - 1, -1, -(2**63)])
    obj = {"op": "fire", "ws": rng.choice(h.ws), "tokens": [1], "readouts": [readout], "fold": 0}
    return [c.build("sampler_extremes", _with_id(obj))]


def case_huge_readout(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    rows = rng.choice([[0] * 300_000, list(range(300_000)), [0] * 5000, [1] * 10])
    kind = rng.choice(["argmax", "logits", "hidden", "distribution"])
    obj = {"op": "fire", "ws": rng.choice(h.ws), "tokens": [1], "readouts": [{"rows": rows, "kind": kind}], "fold": 0}
    if rng.random() < 0.3:  # many readouts instead of many rows
        obj["readouts"] = [{"rows": [0], "kind": "logits"}] * 20_000
    return [c.build("huge_readout", _with_id(obj))]


def _parents(rng: random.Random, n: int) -> list[Any]:
    """A tree window's parents: a valid tree, or one with a parent at or after its child, out of range, of the
    wrong length or type, or wider than the limit."""
    valid = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    which = rng.randrange(7)
    if which == 0:
        return valid
    if which == 1:  # a parent at or after its child (a cycle or a forward edge)
        i = rng.randrange(n)
        return valid[:i] + [rng.randrange(i, n)] + valid[i + 1 :]
    if which == 2:
        return valid[:-1] + [rng.choice([-2, n, 2**31, -(2**63), 2**64 - 1])]
    if which == 3:
        return valid + [-1] * rng.randrange(1, 4)  # more parents than rows
    if which == 4:
        return [-1] + [rng.randrange(-1, i) for i in range(1, rng.choice([65, 200, 5000]))]
    if which == 5:
        return [rng.choice(WRONG_VALUES) for _ in range(n)]
    return []


def case_trees(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    """Tree windows with hostile parents, fold paths and settles (rows that are no path from the root, repeated,
    out of range, on a chain fire), and MTP/EAGLE readouts on trees."""
    n = rng.randrange(1, 9)
    ws = rng.choice(h.ws)
    parents = _parents(rng, n)
    tokens = [rng.randrange(h.vocab) for _ in range(max(1, len(parents)) if rng.random() < 0.2 else n)]
    path = rng.choice([[0], list(range(n)), [0, 0], [n], [-1], [0, n + 5], list(range(n))[::-1], []])
    readout: dict[str, Any] = {"rows": list(range(min(n, 4))), "kind": rng.choice(["argmax", "mtp", "eagle"])}
    if readout["kind"] != "argmax":
        readout.update(k=rng.choice([1, 2, 99]), at_accepted=rng.random() < 0.5)
    fire: dict[str, Any] = {"op": "fire", "ws": ws, "tokens": tokens, "parents": parents, "readouts": [readout]}
    fire["fold"] = rng.choice([path, "deferred", 0, None])
    if rng.random() < 0.3:
        fire["settle"] = rng.choice([path, 1, [0, 0]])
    msgs = [c.build("trees", _with_id(fire))]
    if rng.random() < 0.5:
        msgs.append(c.build("trees", _with_id({"op": "ws_fold", "ws": ws, "n": path})))
    return msgs


def case_channel_waits(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    """Takes that cannot be served: min past the capacity, and a take waiting on a fire that is released."""
    ch = rng.choice(h.channels)
    if rng.random() < 0.5:
        return [
            c.build(
                "channel_waits",
                _with_id(
                    {"op": rng.choice(["channel_take"]), "channel": ch, "max": 4096, "min": rng.choice([2, 4096])}
                ),
            )
        ]
    ws = rng.choice(h.ws)
    fire = {"op": "fire", "ws": ws, "tokens": [1], "program": h.program, "bindings": [ch], "fold": 0}
    then_release = {"op": "ws_release", "ws": ws}
    then = rng.choice([then_release, {"op": "channel_close", "channel": ch}])
    # emptied first: a fire whose put finds the channel full waits (documented) until the host takes
    drain = {"op": "channel_take", "channel": ch, "max": 4096, "min": 1}
    if rng.random() < 0.5:  # the sequence: one cell in, so the fire waits for room; then it is dropped
        one = {"op": "channel_put", "channel": ch, "value": {"dtype": "int32", "shape": [1], "data": b"\x01\0\0\0"}}
        return [
            c.build("channel_waits", _with_id(m))
            for m in (drain, one, fire, {"op": "channel_take", "channel": ch, "max": 2, "min": 2}, then_release)
        ]
    return [
        c.build("channel_waits", _with_id(drain)),
        c.build("channel_waits", _with_id(fire)),
        c.build("channel_waits", _with_id({"op": "channel_take", "channel": ch, "max": 2, "min": 2})),
        c.build("channel_waits", _with_id(then)),
    ]


def case_spec_report(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    """Counts near and past 2**64 (their sums must not break ``stats``) under fresh or shared names."""
    big = rng.choice([2**64 - 1, 2**63, 2**53 + 1, 10**18])
    name = f"fuzz-{rng.getrandbits(48):012x}" if rng.random() < 0.7 else "fuzz"  # fresh names, or sums that overflow
    proposed = rng.choice([1, big])
    per_position = [rng.choice([0, big])] * rng.choice([0, 1, 64])
    report = {
        "op": "spec_report",
        "model": h.model,
        "inferlet": name,
        "rounds": big,
        "proposed": proposed,
        "accepted": rng.choice([0, proposed]),
        "rounds_with_rejection": rng.choice([0, big]),
        "proposed_per_position": per_position,
        "accepted_per_position": per_position,
        "reached_per_position": per_position,
        "skipped": {f"r{rng.getrandbits(32):x}": big for _ in range(rng.choice([0, 1, 32]))},
        "decode_tokens": rng.choice([0, big]),
        "decode_s": rng.choice([1e308, math.inf, math.nan, 0.0, 1.0]),
    }
    return [c.build("spec_report", _with_id(report)), c.build("spec_report", _with_id({"op": "stats"}))]


def case_flood(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    """Many fires at once, without waiting: each must be answered, with no gap of the bound between replies."""
    n = rng.choice([20, 50, 100])
    out = []
    for _ in range(n):
        ws = rng.choice(h.ws)
        obj = rng.choice(
            [
                {"op": "fire", "ws": ws, "tokens": [rng.randrange(h.vocab)], "fold": 0},
                {"op": "fire", "ws": ws, "tokens": [1, 2, 3], "readouts": [{"rows": [2], "kind": "argmax"}], "fold": 0},
                {"op": "fire", "ws": ws, "tokens": [1] * 64, "readouts": [{"rows": [63], "kind": "logits"}], "fold": 0},
                {"op": "ping"},
                {"op": "stats"},
            ]
        )
        out.append(c.build("flood", _with_id(obj)))
    return out


def case_hello(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    version = rng.choice([PROTOCOL_VERSION + 1, 0, -1, 2**64 - 1, PROTOCOL_VERSION])
    obj = {
        "op": "hello",
        "version": version,
        "client": rng.choice(["", "x" * 10_000, "\x00"]),
        "token": rng.choice([None, "t"]),
    }
    return [c.build("hello", _with_id(obj))]  # fmt: skip


def case_oversize(c: Conn, h: Handles, rng: random.Random) -> list[Msg]:
    data = pack({"id": c.new_id(), "op": "ping", "pad": b"\x00" * (17 * 1024 * 1024)})
    return [Msg("oversize", data, "ping padded to 17 MiB", "ping")]


CaseFn = Callable[[Conn, Handles, random.Random], list[Msg]]
KINDS: dict[str, tuple[CaseFn, float]] = {  # kind → (case, weight)
    "random_bytes": (case_random_bytes, 10),
    "non_map": (case_non_map, 5),
    "wrong_types": (case_wrong_types, 25),
    "huge_numbers": (case_huge_numbers, 15),
    "foreign_handles": (case_foreign_handles, 10),
    "lying_arrays": (case_lying_arrays, 10),
    "channel_open": (case_channel_open_extremes, 4),
    "deep_program": (case_deep_program, 2),
    "huge_program": (case_huge_program, 4),
    "program_memory": (case_program_memory, 0.5),
    "sampler_extremes": (case_sampler_extremes, 8),
    "huge_readout": (case_huge_readout, 1),
    "channel_waits": (case_channel_waits, 4),
    "trees": (case_trees, 6),
    "spec_report": (case_spec_report, 3),
    "flood": (case_flood, 0.4),
    "hello": (case_hello, 2),
    "oversize": (case_oversize, 0.05),
}
