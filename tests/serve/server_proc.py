"""A real `pie serve` process for the HTTP API tests: started on a free loopback port with a test store,
awaited until it prints that it is ready, stopped with SIGTERM (the drain path) and killed if it lingers."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    log: Path
    statuses_while_loading: list[int] = field(default_factory=list)
    completion_while_loading: dict | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def pie_serve_cmd(port: int, model: str, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pie_runtime.cli.main",
        "serve",
        "--model",
        model,
        "--http",
        f"127.0.0.1:{port}",
        *flags,
    ]


def start_serve(
    pie_home: Path, model: str, *flags: str, watch_loading: bool = False, env: dict[str, str] | None = None
) -> Served:
    """Starts `pie serve` and returns once it says it is ready. With ``watch_loading`` it polls /health (and
    tries one completion) from the moment the port opens, recording what a client sees while the model loads."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="pie-serve-", suffix=".log")[1])
    env = {**os.environ, "PIE_HOME": str(pie_home), "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("w") as err:
        proc = subprocess.Popen(
            pie_serve_cmd(port, model, *flags), stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO
        )
    served = Served(proc, port, log)
    assert proc.stdout is not None
    deadline = time.monotonic() + 900  # a safety net for a hung start, not a bound under test
    while time.monotonic() < deadline:
        if watch_loading and port_open(port):
            try:
                r = httpx.get(f"{served.base}/health", timeout=30)
                served.statuses_while_loading.append(r.status_code)
                if r.status_code == 503 and served.completion_while_loading is None:
                    body = {"model": model, "prompt": "hi", "max_tokens": 1}
                    c = httpx.post(f"{served.base}/v1/completions", json=body, timeout=30)
                    served.completion_while_loading = {"status": c.status_code, **c.json()}
            except httpx.HTTPError:
                pass
        ready, _, _ = select.select([proc.stdout], [], [], 0.05 if watch_loading else 600)
        if ready:
            line = proc.stdout.readline()
            if "pie serve ready" in line:
                return served
            if not line and proc.poll() is not None:
                pytest.fail(f"pie serve exited {proc.returncode}: {served.stderr()[-3000:]}")
        elif not watch_loading:
            break
    proc.kill()
    pytest.fail(f"pie serve did not get ready: {served.stderr()[-3000:]}")


def assert_refused_before_bind(pie_home: Path, model: str, flags: list[str], says: str) -> None:
    """`pie serve` with ``flags`` ends with an error naming ``says`` on stderr, and its port never accepts a
    connection while the command runs."""
    port = free_port()
    env = {**os.environ, "PIE_HOME": str(pie_home)}
    proc = subprocess.Popen(
        pie_serve_cmd(port, model, *flags), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
    )
    bound: list[bool] = []
    watching = threading.Event()

    def watch() -> None:  # the port must never accept a connection while the command runs
        while proc.poll() is None:
            bound.append(port_open(port))
            watching.set()
        watching.set()

    threading.Thread(target=watch, daemon=True).start()
    out, err = proc.communicate(timeout=300)
    assert watching.wait(10)
    assert proc.returncode != 0
    assert not any(bound) and not port_open(port)
    assert says in err, err
    assert "ready" not in out
