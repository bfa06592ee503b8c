"""Fault containment and shared-state bounds in the engine core, in process (see test_core.py's ``Core``):
a fault in one fire fails only that fire, waiters are always answered, per-client caps, and the
speculation totals stay bounded and overflow-safe."""

from __future__ import annotations

import numpy as np
import pytest

from pie_runtime.engine.server import PRE_AUTH_BYTES, EngineServer
from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol.arrays import decode_array
from pie_runtime.protocol.codec import pack

from .test_core import PROMPT, A, B, Core, logits_of

ARGMAX_PUT = [
    {"op": "logits", "inputs": [], "attrs": {"rows": [0]}},
    {"op": "argmax", "inputs": [0], "attrs": {"dim": -1, "keepdim": False}},
    {"op": "put", "inputs": [1], "attrs": {"slot": 0, "shape": [1], "dtype": "int32"}},
]


def int_cell(v: int) -> dict:
    return {"dtype": "int32", "shape": [1], "data": np.array([v], np.int32).tobytes()}


def waiting_take(c: Core) -> tuple[int, int, int]:
    """A working set W, a channel C (capacity 2) holding one value, a fire writing C queued, and a take of 2
    waiting on it."""
    ws = c.call(A, "ws_open")["ws"]
    ch = c.call(A, "channel_open", shape=[1], dtype="int32", capacity=2)["channel"]
    c.call(A, "channel_put", channel=ch, value=int_cell(42))
    prog = c.call(A, "program_register", nodes=ARGMAX_PUT)["program"]
    c.fire(A, ws, [1], program=prog, bindings=[ch])
    take_id, reply = c.request(A, "channel_take", channel=ch, max=2, min=2)
    assert reply is None  # waits for the fire
    return ws, ch, take_id


def test_a_take_waiting_on_a_released_working_set_is_answered_at_once():
    c = Core()
    ws, _, take_id = waiting_take(c)
    c.call(A, "ws_release", ws=ws)
    replies = {r["id"]: r for _, r in c.core.drain_outbox()}
    assert take_id in replies, "the waiting take was not answered"
    r = replies[take_id]
    assert r["ok"] and r["count"] == 1 and decode_array(r["value"]).tolist() == [[42]]  # short
    assert not c.core.has_work()


def test_a_client_holds_at_most_max_working_sets(monkeypatch):
    from pie_runtime.engine import ws_requests

    monkeypatch.setattr(ws_requests, "MAX_WORKING_SETS", 3)
    c = Core()
    first = c.call(A, "ws_open")["ws"]
    c.call(A, "ws_fork", ws=first)
    c.call(A, "ws_open")
    for op, fields in (("ws_open", {}), ("ws_fork", {"ws": first})):
        with pytest.raises(PieError) as e:
            c.call(A, op, **fields)
        assert e.value.code == ErrorCode.LIMIT_EXCEEDED and "MAX_WORKING_SETS" in e.value.message
    assert c.call(B, "stats")["working_sets"] == 3
    c.call(B, "ws_open")  # another client's cap is its own
    c.call(A, "ws_release", ws=first)
    c.call(A, "ws_open")  # room again
    assert c.core.drop_client(A) == 3
    for _ in range(3):
        c.call(A, "ws_open")  # a departed identity starts from zero


def tcp_server(monkeypatch) -> tuple[EngineServer, list[dict]]:
    """An EngineServer on tcp:// with a token, driven by calling ``_handle``; its replies collected."""
    server = EngineServer(Core().core, "tcp://127.0.0.1:*", token="sesame")
    sent: list[dict] = []
    monkeypatch.setattr(server, "_send", lambda client, reply: sent.append(reply))
    return server, sent


def test_tcp_auth_comes_first_and_only_a_fully_successful_hello_authenticates(monkeypatch):
    from pie_runtime.protocol import messages as m

    server, sent = tcp_server(monkeypatch)
    try:
        calls = []
        monkeypatch.setattr("pie_runtime.engine.server.parse_request", lambda p: calls.append(p) or (_ for _ in ()))
        huge_fire = pack({"id": 1, "op": "fire", "ws": 1, "tokens": [1] * 100_000})
        for payload in (huge_fire, b"\xc1not msgpack", pack([1, 2]), pack({"id": 2, "op": "hello", "token": "no"})):
            server._handle(A, payload)
        assert calls == []  # refused before any validation
        assert [r["error"]["code"] for r in sent] == ["unauthorized"] * 4
        # a message past PRE_AUTH_BYTES is refused unread: not even its id is looked at
        assert [r["id"] for r in sent] == [None, None, None, 2]
        unpacked = []
        monkeypatch.setattr("pie_runtime.engine.server.unpack", lambda p: unpacked.append(p) or {})
        server._handle(A, pack({"id": 9, "op": "hello", "token": "x" * PRE_AUTH_BYTES}))
        assert unpacked == [] and sent[-1]["error"]["code"] == "unauthorized"
        sent.clear()
        monkeypatch.undo()
        monkeypatch.setattr(server, "_send", lambda client, reply: sent.append(reply))
        monkeypatch.undo()
        monkeypatch.setattr(server, "_send", lambda client, reply: sent.append(reply))
        sent.clear()
        server._handle(A, pack({"id": 3, "op": "hello", "version": m.PROTOCOL_VERSION + 1, "token": "sesame"}))
        server._handle(A, pack({"id": 4, "op": "ws_open"}))
        assert [r["error"]["code"] for r in sent] == ["version_mismatch", "unauthorized"]
        assert A not in server.authed
        sent.clear()
        server._handle(A, pack({"id": 5, "op": "hello", "version": m.PROTOCOL_VERSION, "token": "sesame"}))
        server._handle(A, pack({"id": 6, "op": "ws_open"}))
        assert [r["ok"] for r in sent] == [True, True], sent
        server._handle(B, pack({"id": 7, "op": "ws_open"}))  # another client is still refused
        assert sent[-1]["error"]["code"] == "unauthorized"
    finally:
        server.sock.close(0)
        server.monitor.close(0)


def report(c: Core, client: bytes = A, **fields) -> dict:
    base = {"inferlet": "spec", "rounds": 1, "proposed": 1, "accepted": 0, "rounds_with_rejection": 0}
    return c.call(client, "spec_report", **{**base, **fields})


def test_spec_totals_saturate_instead_of_overflowing_the_stats_reply():
    from pie_runtime.protocol.spec_counters import MAX_TOTAL

    c = Core()
    top = 2**53 - 1
    for bad in ({"rounds": 2**64 - 1}, {"rounds": 2**53}, {"decode_s": float("inf")}, {"skipped": {"x": -1}}):
        with pytest.raises(PieError) as e:
            c.request(
                A,
                "spec_report",
                inferlet="spec",
                proposed=1,
                accepted=0,
                rounds_with_rejection=0,
                **{"rounds": 1, **bad},
            )
        assert e.value.code == ErrorCode.BAD_MESSAGE
    big = {
        "rounds": top,
        "proposed": top,
        "accepted": top,
        "rounds_with_rejection": top,
        "decode_tokens": top,
        "proposed_per_position": [top],
        "accepted_per_position": [top],
        "reached_per_position": [top],
        "skipped": {"no_draft": top},
        "decode_s": 1e12,
        "prefill_ms": 1e12,
    }
    for _ in range(1100):  # 1100 * (2**53 - 1) > 2**63
        report(c, **big)
    stats = c.call(B, "stats")
    pack(stats)  # encodable
    t = stats["speculation"]["tiny"]["spec"]
    assert t["runs"] == 1100 and t["rounds"] == t["proposed"] == t["accepted"] == MAX_TOTAL
    assert t["skipped"] == {"no_draft": MAX_TOTAL} and t["acceptance"] == 1.0


def test_spec_totals_keep_a_bounded_set_of_names_and_reasons():
    from pie_runtime.engine.spec_totals import MAX_INFERLETS, OTHER

    c = Core()
    before = len(pack(c.call(A, "stats")))
    report(c, inferlet="kept", skipped={"no_draft": 2, "made-up": 3, "another": 1})
    for i in range(3000):
        report(c, B, inferlet=f"fresh-{i}", skipped={f"reason-{i}": 1})
    spec = c.call(A, "stats")["speculation"]["tiny"]
    assert len(spec) == MAX_INFERLETS + 1 and spec[OTHER]["runs"] == 3001 - MAX_INFERLETS
    assert spec["kept"]["skipped"] == {"no_draft": 2, OTHER: 4}
    assert spec[OTHER]["skipped"] == {OTHER: 3001 - MAX_INFERLETS}
    assert len(pack(c.call(A, "stats"))) < before + 64 * 1024


GUILTY = 96  # a token whose forward raises, in the fault tests below


def faulty_forward(c: Core, monkeypatch, exc: Exception) -> list[int]:
    """Makes the runner's forward raise ``exc`` for any batch holding GUILTY; returns the batch sizes run."""
    runner = c.core.models["tiny"].runner
    real = runner.forward
    sizes: list[int] = []

    def forward(segments, tokens, positions, tails=None, scores=None):
        sizes.append(len(tokens))
        if GUILTY in tokens:
            raise exc
        return real(segments, tokens, positions, tails, scores=scores)

    monkeypatch.setattr(runner, "forward", forward)
    return sizes


def test_a_forward_fault_fails_only_the_guilty_fire_and_the_step_goes_on(monkeypatch):
    solo = Core()
    ws = solo.call(A, "ws_open")["ws"]
    alone = solo.fire(A, ws, PROMPT[:5], readouts=[{"rows": [4], "kind": "logits"}])
    expected = logits_of(solo.run()[alone])

    c = Core(num_pages=16)
    sizes = faulty_forward(c, monkeypatch, RuntimeError("boom"))
    good_ws, bad_ws = c.call(A, "ws_open")["ws"], c.call(B, "ws_open")["ws"]
    good = c.fire(A, good_ws, PROMPT[:5], readouts=[{"rows": [4], "kind": "logits"}])
    bad = c.fire(B, bad_ws, [1, GUILTY, 2], fold=3)
    later = c.fire(B, bad_ws, [3])  # counts on the guilty fire's fold: fails with it
    replies = c.run()
    assert sizes[:3] == [8, 5, 3]  # the batch, then each fire alone
    np.testing.assert_allclose(logits_of(replies[good]), expected, rtol=1e-4, atol=1e-4)
    assert replies[bad]["error"]["code"] == "internal" and "RuntimeError" in replies[bad]["error"]["message"]
    assert replies[later]["error"]["code"] == "internal" and "earlier fire" in replies[later]["error"]["message"]
    assert c.call(B, "ws_fork", ws=bad_ws)["committed"] == 0  # nothing folded, nothing in flight
    assert c.pages_free() == 16 - 2  # A's 5 rows; B's reserved pages came back
    again = c.fire(B, bad_ws, [4, 5])  # the engine and the working set go on
    assert c.run()[again]["committed"] == 2


def test_a_fault_in_a_later_chunk_does_not_advance_the_fire_twice(monkeypatch):
    c = Core(num_pages=16, max_batch_tokens=4)
    faulty_forward(c, monkeypatch, PieError(ErrorCode.INVALID_ARGUMENT, "refused"))
    ws, other = c.call(A, "ws_open")["ws"], c.call(B, "ws_open")["ws"]
    bad = c.fire(A, ws, PROMPT[:6] + [GUILTY])  # its second chunk raises
    good = c.fire(B, other, PROMPT[:9], readouts=[{"rows": [8], "kind": "argmax"}])
    replies = c.run()
    assert replies[bad]["error"] == {"code": "invalid_argument", "message": "refused"}  # a PieError as it is
    assert replies[good]["ok"] and replies[good]["committed"] == 9
    assert c.pages_free() == 16 - 3


def test_a_readout_fault_is_retried_fire_by_fire(monkeypatch):
    c = Core()
    runner = c.core.models["tiny"].runner
    real = runner.readouts
    batches: list[int] = []

    def readouts(requests):
        batches.append(len(requests))
        if any(len(r.spec.rows) == 3 for r in requests):
            raise MemoryError("can't allocate")
        return real(requests)

    monkeypatch.setattr(runner, "readouts", readouts)
    ws_a, ws_b = c.call(A, "ws_open")["ws"], c.call(B, "ws_open")["ws"]
    good = c.fire(A, ws_a, [1, 2], readouts=[{"rows": [1], "kind": "argmax"}])
    bad = c.fire(B, ws_b, [1, 2, 3], readouts=[{"rows": [0, 1, 2], "kind": "argmax"}], fold=3)
    replies = c.run()
    assert batches == [2, 1, 1]
    assert replies[good]["ok"] and replies[good]["committed"] == 2
    assert replies[bad]["error"]["code"] == "internal" and "MemoryError" in replies[bad]["error"]["message"]
    assert c.call(B, "ws_fork", ws=ws_b)["committed"] == 3  # all its rows ran: the host's fold applies


def test_an_epilogue_fault_fails_its_fire_poisons_its_channel_and_answers_the_waiting_take(monkeypatch):
    from pie_runtime.engine import execute

    def run_program(*args, **kwargs):
        raise ZeroDivisionError("in the program")

    monkeypatch.setattr(execute, "run_program", run_program)
    c = Core()
    _, ch, take_id = waiting_take(c)
    other = c.call(B, "ws_open")["ws"]
    fine = c.fire(B, other, [5])
    replies = c.run()
    fired = next(r for i, r in replies.items() if i not in (take_id, fine))
    assert fired["error"]["code"] == "program_failed" and "ZeroDivisionError" in fired["error"]["message"]
    assert replies[fine]["ok"]
    assert replies[take_id]["error"]["code"] == "channel_poisoned"
