"""Inferlet hosts on their engine's node: ``HostActor`` is a Ray actor pinned (``NodeAffinitySchedulingStrategy``,
not soft) to the node of one engine actor, which starts that engine's host processes there (``serve/inferlet_host.py``),
on the engine's ``ipc://`` address. ``RayLauncher`` is the server's side: a ``HostLauncher``
(``serve/host_process.py``) whose processes are the actor's, so the server's ``HostPool`` supervises, restarts
and kills remote hosts as it does its own children.

Ray carries only that control (start, wait, kill: a call per host's life, not per fire). A run's messages go
on the pool's ZeroMQ control socket, which the hosts reach over ``tcp://`` when the server is on another node.

A host dies with the actor (``--parent``: ``PR_SET_PDEATHSIG``); it is started from the actor's event-loop
thread, which lives as long as the actor (the kernel's parent-death signal follows the thread that forked).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..serve.host_launcher import host_command
from ..serve.limits import HostLimits, host_env

_TAIL = 40  # stderr lines kept per host, for the reason it died


class _Proc:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.tail: deque[str] = deque(maxlen=_TAIL)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None  # PIPE
        for line in self.proc.stderr:
            self.tail.append(line)
            sys.stderr.write(line)  # the actor's log (Ray's worker logs on that node)


class HostActor:
    """Starts, waits for and kills inferlet host processes on its node (an async actor: its calls overlap)."""

    def __init__(self) -> None:
        self._procs: dict[int, _Proc] = {}

    async def where(self) -> tuple[str, int]:
        """(Ray node id, this actor's pid): the node its hosts run on, and their parent."""
        return ray.get_runtime_context().get_node_id(), os.getpid()

    async def spawn(self, args: list[str], extra_env: dict[str, str], limits: HostLimits | None) -> int:
        proc = subprocess.Popen(
            host_command(args, os.getpid()),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=host_env(limits, extra_env),
        )
        self._procs[proc.pid] = _Proc(proc)
        return proc.pid

    async def wait(self, pid: int) -> tuple[int, list[str]]:
        """Its exit code and its last stderr lines, once it has exited."""
        p = self._procs[pid]
        code = await asyncio.to_thread(p.proc.wait)
        await asyncio.sleep(0.05)  # its last lines reach the tail
        self._procs.pop(pid, None)
        return code, list(p.tail)

    async def kill(self, pid: int) -> None:
        p = self._procs.get(pid)
        if p is not None and p.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.proc.kill()

    async def pids(self) -> list[int]:
        return [pid for pid, p in self._procs.items() if p.proc.poll() is None]


class RemoteHostProcess:
    """The server's handle on a host that ``actor`` started (``serve/host_process.HostProcess``)."""

    def __init__(self, actor: Any, pid: int, on_gone: Callable[[], None]) -> None:
        self.actor = actor
        self.pid = pid
        self.on_gone = on_gone
        self._code: int | None = None
        self._tail: list[str] = []
        self._exited = asyncio.Event()
        self._waiter: asyncio.Task | None = None

    @property
    def returncode(self) -> int | None:
        return self._code

    async def wait(self) -> int:
        if self._waiter is None:
            self._waiter = asyncio.ensure_future(self._wait())
        await asyncio.shield(self._waiter)
        assert self._code is not None
        return self._code

    async def _wait(self) -> None:
        try:
            self._code, self._tail = await self.actor.wait.remote(self.pid)
        except Exception as e:  # noqa: BLE001 - Ray's errors: the actor (or its node) is gone, and the host with it
            self._code, self._tail = -9, [f"its host actor is gone ({type(e).__name__})\n"]
            self.on_gone()
        self._exited.set()

    def kill(self) -> None:
        if self._code is None:
            self.actor.kill.remote(self.pid)  # fire and forget: wait() reports the exit

    async def lines(self) -> AsyncIterator[str]:
        """Its last stderr lines, once it has exited (the full log stays on its node)."""
        await self._exited.wait()
        for line in self._tail:
            yield line


class RayLauncher:
    """Starts hosts through one ``HostActor``; ``on_gone`` is called (maybe more than once) when the actor is
    found dead, so that the engine's hosts get a new one."""

    def __init__(self, actor: Any, on_gone: Callable[[], None] | None = None) -> None:
        self.actor = actor
        self.on_gone = on_gone or (lambda: None)

    async def spawn(self, args: list[str], extra_env: dict[str, str], limits: HostLimits | None) -> RemoteHostProcess:
        try:
            pid = await self.actor.spawn.remote(args, extra_env, limits)
        except RayActorError:
            self.on_gone()
            raise
        return RemoteHostProcess(self.actor, pid, self.on_gone)


def host_actor(node_id: str) -> Any:
    """A host actor on node ``node_id`` (where an engine actor is); it uses no CPU of Ray's accounting, as the
    hosts mostly wait on their engine."""
    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return ray.remote(HostActor).options(num_cpus=0, scheduling_strategy=strategy, max_restarts=0).remote()
