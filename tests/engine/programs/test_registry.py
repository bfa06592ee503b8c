"""A client's programs are bounded (engine/programs/registry.py), in process on the tiny core: unregister,
least-recently-used eviction past ``--max-programs`` that spares programs of queued fires, a typed refusal
when every held program is in use, unregistering under a queued fire, and departure dropping them."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from examples.hostile_tenant import plus
from pie_runtime.cli.engine import add_engine_options
from pie_runtime.engine.options import DEFAULT_MAX_PROGRAMS
from pie_runtime.engine.programs.registry import ProgramTable
from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol.arrays import decode_array
from pie_runtime.protocol.codec import pack, parse_request
from tests.engine.test_core import PROMPT, A, B, Core


def capped(n: int) -> Core:
    c = Core()
    c.core.programs.programs = ProgramTable(n)
    return c


def setup(c: Core, client: bytes = A) -> tuple[int, int]:
    """A working set and a channel of capacity 8 for ``client``."""
    ws = c.call(client, "ws_open")["ws"]
    ch = c.call(client, "channel_open", shape=[1], dtype="int32", capacity=8)["channel"]
    return ws, ch


def register(c: Core, k: int, client: bytes = A) -> str:
    return c.call(client, "program_register", nodes=plus(k))["program"]


def refused(code: ErrorCode, fn, *args, **fields) -> PieError:
    with pytest.raises(PieError) as e:
        fn(*args, **fields)
    assert e.value.code == code, e.value
    return e.value


def test_an_unregistered_program_is_gone_and_unregistering_twice_is_harmless():
    c = Core()
    ws, ch = setup(c)
    h = register(c, 1)
    assert c.call(A, "program_unregister", program=h) == {"removed": True}
    assert c.call(A, "program_unregister", program=h) == {"removed": False}
    refused(ErrorCode.UNKNOWN_PROGRAM, c.fire, A, ws, [1], program=h, bindings=[ch])
    assert register(c, 1) == h  # registered again under the same name
    assert c.call(B, "program_unregister", program=h) == {"removed": False}  # A's program is not B's to drop
    assert c.call(A, "stats")["programs"] == 1
    fire = c.fire(A, ws, [1], program=h, bindings=[ch])
    assert c.run()[fire]["ok"]


@pytest.mark.parametrize("program", ["", "XYZ", "0" * 31, "g" * 32, "0" * 33, 7])
def test_unregister_takes_a_program_hash(program):
    refused(ErrorCode.BAD_MESSAGE, parse_request, pack({"id": 1, "op": "program_unregister", "program": program}))


def test_unregistering_the_program_of_a_queued_fire_lets_the_fire_finish():
    c = Core()
    ws, ch = setup(c)
    h = register(c, 5)
    fire = c.fire(A, ws, PROMPT, program=h, bindings=[ch])
    assert c.call(A, "program_unregister", program=h) == {"removed": True}
    assert c.run()[fire]["ok"]
    (cell,) = decode_array(c.call(A, "channel_take", channel=ch)["value"])
    assert c.call(A, "stats")["programs"] == 0
    c2 = Core()  # the same fire with the program still registered puts the same value
    ws2, ch2 = setup(c2)
    c2.fire(A, ws2, PROMPT, program=register(c2, 5), bindings=[ch2])
    c2.run()
    assert np.array_equal(cell, decode_array(c2.call(A, "channel_take", channel=ch2)["value"])[0])


def test_past_the_cap_the_least_recently_used_program_is_evicted():
    c = capped(3)
    ws, ch = setup(c)
    p0, p1, p2 = register(c, 0), register(c, 1), register(c, 2)
    c.fire(A, ws, [1], program=p0, bindings=[ch])  # a fire uses p0: p1 is now the least recently used
    c.run()
    p3 = register(c, 3)
    table = c.core.programs.programs
    assert table.held(A) == [p2, p0, p3] and table.evictions == 1
    refused(ErrorCode.UNKNOWN_PROGRAM, c.fire, A, ws, [1], program=p1, bindings=[ch])
    assert register(c, 1) == p1  # registering it again evicts the next oldest
    assert table.held(A) == [p0, p3, p1]
    assert register(c, 0) == p0 and table.held(A) == [p3, p1, p0]  # registering a held one only touches it
    assert table.evictions == 2 and c.call(A, "stats")["program_evictions"] == 2
    assert [register(c, k, B) for k in range(3)] and table.held(A) == [p3, p1, p0]  # B's cap is its own


def test_programs_of_queued_fires_are_never_evicted_and_all_in_use_is_refused():
    c = capped(2)
    ws, ch = setup(c)
    ws2 = c.call(A, "ws_open")["ws"]
    p0, p1 = register(c, 0), register(c, 1)
    c.fire(A, ws, [1], program=p0, bindings=[ch])
    c.fire(A, ws2, [1], program=p1, bindings=[ch])
    err = refused(ErrorCode.LIMIT_EXCEEDED, c.call, A, "program_register", nodes=plus(2))
    assert "--max-programs" in err.message
    assert c.core.programs.programs.held(A) == [p0, p1]  # the refusal changed nothing
    c.step()  # both fires finish: their programs may go
    p2 = register(c, 2)
    assert c.core.programs.programs.held(A) == [p1, p2]


def test_a_departed_client_holds_no_program():
    c = Core()
    for k in range(3):
        register(c, k, A)
    kept = register(c, 0, B)
    c.core.drop_client(A)
    assert c.core.programs.programs.held(A) == [] and c.core.programs.programs.held(B) == [kept]
    assert c.call(B, "stats")["programs"] == 1


def test_the_engine_flag_sets_the_cap():
    p = argparse.ArgumentParser()
    add_engine_options(p)
    assert p.parse_args([]).max_programs == DEFAULT_MAX_PROGRAMS
    assert p.parse_args(["--max-programs", "8"]).max_programs == 8
    with pytest.raises(SystemExit):
        p.parse_args(["--max-programs", "0"])
    with pytest.raises(ValueError):
        ProgramTable(0)
