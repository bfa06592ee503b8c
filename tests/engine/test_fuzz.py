"""Hostile clients cannot hurt the engine: seeded malformed and adversarial messages over a real socket
(``examples/fuzz_engine.py``) leave it alive, answering every request within a bound and never with
``internal``, with no page leaked, its RSS near its baseline and a valid client's greedy answer unchanged.

A fresh engine per test (not the shared ``tiny_engine``): a crash found here must not take the rest of the
session's tests with it, and the RSS baseline must be this engine's own."""

from __future__ import annotations

import random
import socket
import time

import pytest

from examples.fuzz_engine import BOUND_S, FuzzReport, fuzz
from pie_runtime.launcher import EmbeddedEngine
from pie_runtime.protocol.codec import pack, unpack
from tests.conftest import TINY, start_engine

MESSAGES = 2000
# RSS after the fuzz within +50% of the baseline taken after warm-up (the issue aims at 10% over 20,000
# messages; a short CI run on a small engine leaves the allocator's caches a larger share)
RSS_MARGIN = 0.5


@pytest.fixture
def fuzz_engine(pie_home):
    eng = start_engine(pie_home, [TINY])
    yield eng
    eng.stop()


def explain(report: FuzzReport, engine: EmbeddedEngine) -> str:
    lines = [f"{kind}: {why}" for kind, why in report.first_failure.items()]
    if not report.engine_alive:
        lines.append(f"engine exited (code {engine.proc.poll()}) with in flight: {report.crashed}")
        lines += ["engine log tail:", *engine.log.strip().splitlines()[-8:]]
    return "\n".join(lines)


def test_hostile_messages_leave_the_engine_sound(fuzz_engine):
    report = fuzz(fuzz_engine.address, MESSAGES, seed=1, proc=fuzz_engine.proc)
    why = explain(report, fuzz_engine)
    assert report.engine_alive, f"the engine died:\n{why}"
    assert not report.control_errors, f"a valid request failed: {report.control_errors}\n{why}"
    assert report.messages >= MESSAGES
    assert not report.timeouts, f"not answered within {BOUND_S} s: {report.timeouts[:5]}\n{why}"
    assert not report.internal, f"internal errors: {report.internal[:5]}\n{why}"
    assert report.ping_failures == 0
    assert not report.greedy_mismatches, f"the valid client's greedy answer changed: {report.greedy_mismatches}"
    assert report.foreign_intact, "the fuzzer changed another client's working set or channel"
    assert report.pages_leaked == 0, f"{report.pages_leaked} pages leaked"
    # speculation totals under thousands of fresh names must not outlive the client that sent them
    assert report.stats_bytes_after <= report.stats_bytes_before + 8192, (
        f"stats reply grew from {report.stats_bytes_before} to {report.stats_bytes_after} bytes"
    )
    growth = report.rss_growth
    assert growth is not None and growth < RSS_MARGIN, f"RSS {report.rss_before_kb} → {report.rss_after_kb} kB"


def test_raw_bytes_on_the_engines_socket_leave_it_serving(fuzz_engine):
    """The hostile run's crash, against a real ``pie engine``: a ZMTP 1.0 peer's message and 3 MB of random
    bytes on raw connections (messages that name no connection) once ended its receive loop."""
    import zmq

    path = fuzz_engine.address.removeprefix("ipc://")
    rng = random.Random(5)
    for payload in [bytes([1, 0, 5, 0]) + b"ping", *(rng.randbytes(3 << 20) for _ in range(3))]:
        with socket.socket(socket.AF_UNIX) as raw:
            try:
                raw.connect(path)
            except OSError as e:
                pytest.fail(f"the engine stopped listening ({e}); exit code {fuzz_engine.proc.poll()}")
            try:
                raw.sendall(payload)
            except OSError:
                pass  # the engine hung up on it
            time.sleep(0.1)
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(fuzz_engine.address)
    try:
        client.send(pack({"id": 1, "op": "ws_open"}))
        assert client.poll(10_000), f"no reply; engine exit code {fuzz_engine.proc.poll()}"
        ws = unpack(client.recv())["ws"]
        client.send(
            pack({"id": 2, "op": "fire", "ws": ws, "tokens": [1, 2, 3], "readouts": [{"rows": [2], "kind": "argmax"}]})
        )
        assert client.poll(30_000)
        reply = unpack(client.recv())
        assert reply["ok"] and reply["committed"] == 3, reply
    finally:
        client.close(0)
    assert fuzz_engine.proc.poll() is None
