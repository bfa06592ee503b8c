"""The pool of inferlet host processes that `pie serve` hands its runs to.

Changes to the interface agreed with the APP helper (all additive):
- ``RunFailed.code`` may also be ``"not_found"``: ``run()`` of a name that ``inferlets()`` does not list.
- ``run()`` takes an optional ``timeout`` (seconds; past it the run is cancelled and fails with ``"timeout"``).
- ``HostPool.__init__`` takes optional keywords after the agreed ones: ``max_runs_per_host`` (runs a host
  holds at once; more wait), ``max_waiting`` (waiting runs past which ``run()`` fails with ``"overloaded"``),
  ``heartbeat_s`` and ``heartbeat_timeout_s``, ``start_timeout_s``.
- ``HostLimits`` (``limits.py``, re-exported here) also has ``clean_env``: start the hosts without the
  server's environment (the mode for uploaded code).
- ``inferlets()`` reads the folders on each call, so a file added to an inferlet dir is served at once.
- Also: ``host_pid(run_id)``, ``pids()``, ``restarts`` (for operators and tests).
- ``launcher`` (``host_launcher.py``) starts the hosts: as the server's children by default, or on another
  machine (``cluster/host_actor.py``); ``control_ip`` then binds the control socket on ``tcp://IP:PORT``
  instead of ``ipc://``, and each host's spawn id carries 128 random bits (the only identities it answers).
- ``control_dir``: the folder of the ``ipc://`` control socket (a sandbox's private one, sandbox.py).

``HostPool`` binds a ROUTER control socket on a fresh ``ipc://`` address (``control.py``) and keeps ``workers``
hosts (``inferlet_host.py``) alive: one supervisor task a slot spawns its host, waits for it to exit, fails the runs it
held with ``host_crashed`` and spawns the next (with a growing pause when hosts die at start). A watchdog kills
a host whose heartbeats stopped (its event loop is blocked); the kernel kills every host when the server dies
(``PR_SET_PDEATHSIG``). The engine releases a dead host's working sets when its connection drops.

Runs wait in one FIFO queue and go to the ready host holding the fewest runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import zmq
import zmq.asyncio

from ..launcher import SHIPPED
from . import control as c
from .host_launcher import HostLauncher, HostProcess, LocalLauncher
from .limits import HostLimits

__all__ = ["HostLimits", "HostPool", "RunEvent", "RunFailed"]

FailCode = Literal[
    "inferlet_error", "host_crashed", "cancelled", "timeout", "bad_arguments", "overloaded", "not_found", "engine_lost"
]


class RunFailed(Exception):
    """A run that ended without a result; ``code`` says why."""

    def __init__(self, code: FailCode, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class RunEvent:
    kind: Literal["text", "result"]
    text: str = ""
    result: dict | None = None
    logprobs: list[dict] | None = None  # a text event's tokens' logprobs entries, when the run records them


_Queued = RunEvent | RunFailed


def _joined(
    first: RunEvent, queue: asyncio.Queue[RunEvent | RunFailed]
) -> tuple[RunEvent, RunEvent | RunFailed | None]:
    """``first`` text event with the text events queued behind it joined to it (one SSE frame and one client
    wakeup where a consumer fell behind, not one each), and the first other event taken (or None)."""
    text, lps = [first.text], first.logprobs
    while not queue.empty():
        ev = queue.get_nowait()
        if not (isinstance(ev, RunEvent) and ev.kind == "text"):
            return RunEvent("text", "".join(text), logprobs=lps), ev
        text.append(ev.text)
        lps = None if lps is None and ev.logprobs is None else (lps or []) + (ev.logprobs or [])
    return (RunEvent("text", "".join(text), logprobs=lps) if len(text) > 1 else first), None


@dataclass
class _Host:
    slot: int
    spawn_id: str
    proc: HostProcess
    ready: asyncio.Future[None]
    last_seen: float = 0.0
    runs: dict[str, PooledRun] = field(default_factory=dict)
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    death: str = ""  # why the pool killed it, when it did

    @property
    def is_ready(self) -> bool:
        return self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None


@dataclass
class PooledRun:
    """A run handed to the pool, waiting or on a host: its events as they come and the host that holds it."""

    run_id: str
    inferlet: str
    path: Path
    args: dict
    events: asyncio.Queue[RunEvent | RunFailed] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    host: _Host | None = None
    start: bytes = b""  # its StartRun, encoded once (and checked to decode) when it was handed to the pool


class HostPool:
    def __init__(
        self,
        engine_address: str,
        workers: int = 1,
        *,
        token: str | None = None,
        inferlet_dirs: list[Path] | None = None,
        limits: HostLimits | None = None,
        max_runs_per_host: int = 256,
        max_waiting: int = 1024,
        heartbeat_s: float = 0.5,
        heartbeat_timeout_s: float = 10.0,
        start_timeout_s: float = 120.0,
        launcher: HostLauncher | None = None,
        control_ip: str | None = None,
        control_dir: Path | None = None,
    ):
        if workers < 1:
            raise ValueError("a pool needs at least one host")
        self.engine_address = engine_address
        self.workers = workers
        self.token = token
        self.inferlet_dirs = [Path(d) for d in inferlet_dirs or []]
        self.limits = limits
        self.max_runs_per_host = max_runs_per_host
        self.max_waiting = max_waiting
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.start_timeout_s = start_timeout_s
        self.launcher: HostLauncher = launcher or LocalLauncher()
        self.control_ip = control_ip
        folder = control_dir or Path(tempfile.gettempdir())  # control_dir: a sandbox's private folder
        self.control_address = f"ipc://{folder}/pie-hosts-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
        self._sock: zmq.asyncio.Socket | None = None
        self._hosts: dict[str, _Host] = {}  # spawn id → host (alive, or dead and not yet reaped)
        self._slots: list[_Host | None] = [None] * workers
        self._runs: dict[str, PooledRun] = {}  # waiting and running
        self._waiting: deque[PooledRun] = deque()
        self._tasks: list[asyncio.Task] = []
        self._outbox: asyncio.Queue[tuple[_Host, c.CancelRun | c.Stop | bytes]] = asyncio.Queue()
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._closed = False
        self._failure: RunFailed | None = None
        self._restarts = 0
        self._spawns = itertools.count()

    # --- public interface ---

    async def start(self) -> None:
        """Spawns the hosts; returns when each has connected to the engine (raises when one cannot)."""
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.control_ip is not None:
            sock.bind(f"tcp://{self.control_ip}:*")
            self.control_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            sock.bind(self.control_address)
        self._sock = sock
        self._tasks.append(asyncio.create_task(self._receive()))
        self._tasks.append(asyncio.create_task(self._send()))
        self._tasks.append(asyncio.create_task(self._watchdog()))
        first: list[asyncio.Future[None]] = []
        for slot in range(self.workers):
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            first.append(ready)
            self._tasks.append(asyncio.create_task(self._supervise(slot, ready)))
        try:
            await asyncio.gather(*first)
        except BaseException:
            await self.close()
            raise

    def inferlets(self) -> dict[str, Path]:
        """The shipped inferlets and those in ``inferlet_dirs`` (a later folder's file wins), name → file. A
        custom file never replaces a shipped inferlet (`pie serve` refuses to start with one: custom_models.py)."""
        out = {p.stem: p.resolve() for p in sorted(SHIPPED.glob("*.py")) if not p.stem.startswith("_")}
        shipped = set(out)
        for folder in self.inferlet_dirs:
            for path in sorted(folder.glob("*.py")):
                if not path.stem.startswith("_") and path.stem not in shipped:
                    out[path.stem] = path.resolve()
        return out

    async def run(
        self,
        inferlet: str,
        args: dict,
        *,
        run_id: str | None = None,
        timeout: float | None = None,
        session: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RunEvent]:
        """Streams the run's "text" events, then exactly one "result"; raises RunFailed. Leaving the loop
        early (or the consumer being cancelled) cancels the run. ``session`` (a routing key) means nothing
        with one engine; ``cluster.pool.ClusterPool`` routes by it. ``cache_salt``: its working sets' prefix-cache
        salt (its API key's)."""
        if self._draining:
            raise self._failure or RunFailed("overloaded", "the server is shutting down")
        path = self.inferlets().get(inferlet)
        if path is None:
            raise RunFailed("not_found", f"no inferlet named {inferlet!r}")
        if len(self._waiting) >= self.max_waiting:
            raise RunFailed("overloaded", f"{len(self._waiting)} runs are already waiting for a host")
        run_id = run_id or uuid.uuid4().hex
        if run_id in self._runs:
            raise RunFailed("bad_arguments", f"run id {run_id!r} is in use")
        start = _check_carried(run_id, inferlet, path, args, cache_salt)
        run = PooledRun(run_id, inferlet, path, dict(args), start=start)
        self._runs[run_id] = run
        self._idle.clear()
        self._waiting.append(run)
        self._pump()
        deadline = None if timeout is None else time.monotonic() + timeout
        held: _Queued | None = None  # an event taken from the queue while joining text, not yet given
        try:
            while True:
                if held is not None:
                    event, held = held, None
                elif deadline is None:
                    event = await run.events.get()
                else:
                    try:
                        event = await asyncio.wait_for(run.events.get(), max(deadline - time.monotonic(), 0))
                    except TimeoutError:
                        raise RunFailed("timeout", f"the run took longer than {timeout} s") from None
                if isinstance(event, RunEvent) and event.kind == "text":
                    event, held = _joined(event, run.events)
                if isinstance(event, RunFailed):
                    raise event
                yield event
                if event.kind == "result":
                    return
        finally:
            if not run.done.is_set():
                self._abandon(run)

    async def cancel(self, run_id: str) -> bool:
        """Cancels a waiting or running run; returns when it has ended and its working sets are released
        (False: no such run)."""
        run = self._runs.get(run_id)
        if run is None:
            return False
        self._abandon(run)
        await run.done.wait()
        return True

    def running(self) -> int:
        return len(self._runs) - len(self._waiting)

    def waiting(self) -> int:
        return len(self._waiting)

    async def drain(self, timeout: float) -> None:
        """Takes no more runs; lets the accepted ones finish for up to ``timeout`` seconds, then cancels the rest."""
        self._draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        for run in list(self._runs.values()):
            self._abandon(run)
        await self._idle.wait()

    async def close(self, kill: bool = False, failure: RunFailed | None = None) -> None:
        """Stops every host (asked, then killed; ``kill``: killed at once, as when their engine is gone and
        they could not release anything) and waits for each to exit: no child outlives this. ``failure``: every
        run waiting or running ends with it at once (its engine died), else "cancelled" as each host stops."""
        self._draining = True
        self._closed = True
        self._failure = failure  # what a run asked of this pool from now on fails with
        for run in list(self._runs.values()) if failure is not None else list(self._waiting):
            self._finish(run, failure or RunFailed("cancelled", "the server closed"))
        for host in list(self._hosts.values()):
            if host.is_ready and not kill:
                self._post(host, c.Stop())
            else:  # not connected yet: a Stop would be dropped by the socket
                self._kill(host, "the pool closed")
        for host in list(self._hosts.values()):
            try:
                await asyncio.wait_for(host.proc.wait(), 5.0)
            except TimeoutError:
                self._kill(host, "the pool closed")
                await host.proc.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for run in list(self._runs.values()):
            self._finish(run, RunFailed("cancelled", "the server closed"))
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self.control_address.startswith("ipc://"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.control_address.removeprefix("ipc://"))

    def host_pid(self, run_id: str) -> int | None:
        """The process id of the host running ``run_id`` (None while it waits, or when there is no such run)."""
        run = self._runs.get(run_id)
        return run.host.proc.pid if run is not None and run.host is not None else None

    def pids(self) -> list[int]:
        """The live hosts' process ids."""
        return [h.proc.pid for h in self._hosts.values() if h.proc.returncode is None]

    @property
    def restarts(self) -> int:
        """How many hosts have been spawned again after one died."""
        return self._restarts

    # --- runs ---

    def _pump(self) -> None:
        """Hands waiting runs to the ready hosts with room, the least loaded first."""
        while self._waiting and not self._closed:
            ready = [h for h in self._slots if h is not None and h.is_ready and h.proc.returncode is None]
            room = [h for h in ready if len(h.runs) < self.max_runs_per_host]
            if not room:
                return
            host = min(room, key=lambda h: len(h.runs))
            run = self._waiting.popleft()
            run.host = host
            host.runs[run.run_id] = run
            self._post(host, run.start)

    def _abandon(self, run: PooledRun) -> None:
        """Ends a run from our side: a waiting one at once, a running one by asking its host to cancel it."""
        if run.done.is_set():
            return
        if run.host is None:
            with contextlib.suppress(ValueError):
                self._waiting.remove(run)
            self._finish(run, RunFailed("cancelled", "the run was cancelled before it started"))
        else:
            self._post(run.host, c.CancelRun(run=run.run_id))

    def _finish(self, run: PooledRun, outcome: RunEvent | RunFailed) -> None:
        if run.done.is_set():
            return
        run.events.put_nowait(outcome)
        run.done.set()
        self._runs.pop(run.run_id, None)
        if run.host is not None:
            run.host.runs.pop(run.run_id, None)
        if not self._runs:
            self._idle.set()
        self._pump()

    def _on_message(self, host: _Host, msg: c.Ready | c.Heartbeat | c.Text | c.Result | c.Error) -> None:
        host.last_seen = time.monotonic()
        if isinstance(msg, c.Ready):
            if not host.ready.done():
                host.ready.set_result(None)
            self._pump()
        elif isinstance(msg, c.Heartbeat):
            pass
        else:
            run = host.runs.get(msg.run)
            if run is None:
                return  # a run already failed or abandoned on our side
            if isinstance(msg, c.Text):
                run.events.put_nowait(RunEvent("text", text=msg.text, logprobs=msg.logprobs))
            elif isinstance(msg, c.Result):
                result = msg.result if isinstance(msg.result, dict) else {"value": msg.result}
                self._finish(run, RunEvent("result", result=result))
            else:
                self._finish(run, RunFailed(msg.code, msg.message))

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                continue
            host = self._hosts.get(frames[0].decode(errors="replace"))
            if host is None:
                continue
            try:
                msg = c.decode_to_server(frames[1])
            except ValueError as e:
                print(f"pie serve: dropped a host message that does not validate: {e}", file=sys.stderr)
                continue
            self._on_message(host, msg)

    def _post(self, host: _Host, msg: c.CancelRun | c.Stop | bytes) -> None:
        """Queues a message (or an encoded one) to ``host``; one sender keeps them in order (a cancel never
        overtakes its run)."""
        self._outbox.put_nowait((host, msg))

    async def _send(self) -> None:
        assert self._sock is not None
        while True:
            host, msg = await self._outbox.get()
            if host.proc.returncode is None:  # a message to a dead host has nobody to act on it
                data = msg if isinstance(msg, bytes) else c.encode(msg)
                await self._sock.send_multipart([host.spawn_id.encode(), data])

    # --- hosts ---

    async def _spawn(self, slot: int) -> _Host:
        secret = uuid.uuid4().hex if self.control_ip is not None else uuid.uuid4().hex[:6]
        spawn_id = f"host-{slot}-{next(self._spawns)}-{secret}"
        args = [
            "--control",
            self.control_address,
            "--engine",
            self.engine_address,
            "--id",
            spawn_id,
            "--heartbeat",
            str(self.heartbeat_s),
        ]
        if self.limits is not None:
            args += ["--limits", self.limits.model_dump_json()]
        proc = await self.launcher.spawn(args, {"PIE_TOKEN": self.token} if self.token else {}, self.limits)
        host = _Host(slot, spawn_id, proc, asyncio.get_running_loop().create_future(), time.monotonic())
        self._hosts[spawn_id] = host
        self._slots[slot] = host
        return host

    async def _supervise(self, slot: int, first_ready: asyncio.Future[None]) -> None:
        """Keeps one host alive in ``slot``: spawn, wait for its exit, fail its runs, spawn again."""
        pause = 0.0
        while not self._closed:
            try:
                host = await self._spawn(slot)
            except Exception as e:  # noqa: BLE001 - no process to start (a remote launcher that is gone): retry
                if not first_ready.done():
                    first_ready.set_exception(RuntimeError(f"an inferlet host could not be started: {e}"))
                    return
                pause = min(max(pause * 2, 0.1), 5.0)
                await asyncio.sleep(pause)
                continue
            stderr = asyncio.create_task(self._read_stderr(host))
            exited = asyncio.create_task(host.proc.wait())
            done, _ = await asyncio.wait(
                [exited, host.ready], timeout=self.start_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                self._kill(host, f"it did not connect within {self.start_timeout_s} s")
            started = host.is_ready
            if started and not first_ready.done():
                first_ready.set_result(None)
            code = await exited
            await asyncio.wait([stderr], timeout=1.0)
            reason = host.death or _exit_reason(code)
            if not host.ready.done():
                host.ready.set_exception(RuntimeError(reason))
                host.ready.exception()  # retrieved: nobody else awaits a dead host's ready
            if not first_ready.done():
                tail = "".join(host.stderr_tail).strip().splitlines()
                first_ready.set_exception(
                    RuntimeError(f"an inferlet host did not start ({reason}): {tail[-1] if tail else 'no output'}")
                )
                self._hosts.pop(host.spawn_id, None)
                return
            self._on_host_exit(host, reason)
            if self._closed:
                return
            self._restarts += 1
            pause = 0.0 if started else min(max(pause * 2, 0.1), 5.0)  # hosts dying at start: back off
            await asyncio.sleep(pause)

    def _on_host_exit(self, host: _Host, reason: str) -> None:
        self._hosts.pop(host.spawn_id, None)
        if self._slots[host.slot] is host:
            self._slots[host.slot] = None
        outcome = (
            RunFailed("cancelled", "the server closed")
            if self._closed
            else RunFailed("host_crashed", f"the inferlet host running it died ({reason})")
        )
        for run in list(host.runs.values()):
            self._finish(run, outcome)

    async def _read_stderr(self, host: _Host) -> None:
        """Keeps the last lines for error messages and passes them on to the server's stderr."""
        async for text in host.proc.lines():
            host.stderr_tail.append(text)
            sys.stderr.write(f"[{host.spawn_id}] {text}")

    async def _watchdog(self) -> None:
        """Kills ready hosts that stopped sending heartbeats: their event loop is blocked."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            for host in list(self._hosts.values()):
                silent = now - host.last_seen
                if host.is_ready and host.proc.returncode is None and silent > self.heartbeat_timeout_s:
                    self._kill(host, f"no heartbeat for {silent:.1f} s")

    def _kill(self, host: _Host, why: str) -> None:
        if host.proc.returncode is None:
            host.death = host.death or f"killed: {why}"
            with contextlib.suppress(ProcessLookupError):
                host.proc.kill()


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _check_carried(run_id: str, inferlet: str, path: Path, args: dict, cache_salt: str | None = None) -> bytes:
    """The run's StartRun, encoded; raises RunFailed when the arguments would not arrive: a message that does
    not encode, or that a host drops because it does not decode (map keys that are not strings, say), would
    leave the run waiting."""
    try:
        data = c.encode(c.StartRun(run=run_id, inferlet=inferlet, path=str(path), args=args, cache_salt=cache_salt))
        c.decode_to_host(data)
        return data
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: an int past 64 bits
        raise RunFailed("bad_arguments", f"the run's arguments cannot be sent to a host: {e}") from None
