"""SIGKILL of a real `pie serve`'s engine while requests are in flight (tiny model, each step slowed by
``--simulate-step-ms`` so the requests are still running when the kill lands): every one gets a 503 error
object (a stream: an error event, then ``[DONE]``), ``/health`` reports the death and the restart, and a new
request is served by the new engine without restarting `pie serve`; with ``--no-engine-restart`` the server
stays unhealthy and starts no engine. The restart budget's arithmetic is tested without processes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from pie_runtime.serve.engine_life import RestartPolicy, Restarts
from tests.conftest import TINY
from tests.serve.server_proc import Served, alive, children, start_serve

FLAGS = ("--kv-pages", "128", "--pass-cost-rows", "0", "--simulate-step-ms", "40", "--max-running", "8")
BODY = {"model": TINY, "prompt": "Count:", "max_tokens": 256, "temperature": 0, "ignore_eos": True}


def test_restart_budget_backs_off_and_caps():
    budget = Restarts(RestartPolicy(max_restarts=3, window_s=100, backoff_s=0.5, max_backoff_s=1.5))
    pauses = []
    for t in (0.0, 1.0, 2.0):
        pauses.append(budget.next_pause(t))
        budget.record(t)
    assert pauses == [0.5, 1.0, 1.5]
    assert budget.next_pause(3.0) is None  # three restarts within the window: give up
    assert budget.next_pause(101.5) == 1.0  # the first left the window: one restart is back
    assert Restarts(RestartPolicy(enabled=False)).next_pause(0.0) is None


def health(server: Served) -> httpx.Response:
    return httpx.get(f"{server.base}/health", timeout=30)


def engine_pid(server: Served) -> int:
    """The engine's pid as /health reports it, checked to be the server's child running `pie engine`."""
    pid = health(server).json()["engine"]["pid"]
    assert pid in children(server.proc.pid)
    assert b"engine" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return pid


def in_flight(server: Served) -> tuple[list[threading.Thread], dict[str, object], list[threading.Event]]:
    """Two non-streaming requests and two streams, started; their outcomes land in the dict, and each stream
    sets its event once its first chunk has arrived."""
    out: dict[str, object] = {}
    begun = [threading.Event(), threading.Event()]

    def whole(i: int) -> None:
        r = httpx.post(f"{server.base}/v1/completions", json=BODY, timeout=300)
        out[f"whole{i}"] = (r.status_code, r.json())

    def stream(i: int) -> None:
        lines = []
        with httpx.stream("POST", f"{server.base}/v1/completions", json={**BODY, "stream": True}, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    begun[i].set()
        out[f"stream{i}"] = (r.status_code, lines)
        begun[i].set()

    threads = [threading.Thread(target=f, args=(i,)) for i in range(2) for f in (whole, stream)]
    for t in threads:
        t.start()
    return threads, out, begun


def wait_running(server: Served, begun: list[threading.Event]) -> None:
    """Until the four requests run in hosts and each stream has had its first chunk."""
    for event in begun:
        assert event.wait(300), "a stream did not begin"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        page = httpx.get(f"{server.base}/metrics", timeout=30).text
        running = [ln for ln in page.splitlines() if ln.startswith("pie_requests_running{")]
        if running and float(running[0].split()[-1]) >= 4:
            return
        time.sleep(0.1)
    pytest.fail("the requests did not start")


def assert_all_503(out: dict[str, object]) -> None:
    assert len(out) == 4
    for name, (status, body) in out.items():  # type: ignore[misc]
        if name.startswith("whole"):
            assert status == 503, body
            assert body["error"]["code"] == "engine_lost" and "SIGKILL" in body["error"]["message"]
        else:  # a stream that had begun: 200, some chunks, then an error event and [DONE]
            assert status == 200
            assert body[-1] == "data: [DONE]"
            err = json.loads(body[-2][6:])["error"]
            assert err["code"] == "engine_lost" and err["type"] == "server_error"
            assert any("choices" in json.loads(line[6:]) for line in body[:-2])


@pytest.mark.e2e
def test_sigkill_of_the_engine_under_load_fails_in_flight_and_restarts(pie_home):
    server = start_serve(pie_home, TINY, *FLAGS)
    try:
        first = health(server).json()["engine"]
        assert first["state"] == "up" and first["restarts"] == 0
        pid = engine_pid(server)
        threads, out, begun = in_flight(server)
        wait_running(server, begun)
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=300)
        assert_all_503(out)
        deadline = time.monotonic() + 600
        while health(server).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        h = health(server).json()
        assert h["status"] == "ready"
        assert h["engine"]["state"] == "up" and h["engine"]["restarts"] == 1
        assert h["engine"]["last_exit"]["signal"] == "SIGKILL" and h["engine"]["pid"] != pid
        assert not alive(pid) and engine_pid(server) == h["engine"]["pid"]
        page = httpx.get(f"{server.base}/metrics", timeout=30).text
        assert "pie_engine_up 1.0" in page and "pie_engine_restarts_total 1.0" in page
        r = httpx.post(f"{server.base}/v1/completions", json={**BODY, "max_tokens": 4}, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0


@pytest.mark.e2e
def test_no_engine_restart_leaves_the_server_unhealthy(pie_home):
    server = start_serve(pie_home, TINY, *FLAGS, "--no-engine-restart")
    try:
        pid = engine_pid(server)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while health(server).json()["status"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.1)
        r = health(server)
        assert r.status_code == 503
        h = r.json()
        assert h["status"] == "failed" and "--no-engine-restart" in h["error"]
        assert h["engine"]["state"] == "down" and h["engine"]["restarts"] == 0
        assert h["engine"]["last_exit"]["signal"] == "SIGKILL"
        assert "pie_engine_up 0.0" in httpx.get(f"{server.base}/metrics", timeout=30).text
        refused = httpx.post(f"{server.base}/v1/completions", json=BODY, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
        assert [p for p in children(server.proc.pid) if alive(p) and p != pid] == []  # no engine, no host
    finally:
        server.stop()
