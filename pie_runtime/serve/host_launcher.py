"""How a ``HostPool`` starts its inferlet host processes, and the handle it keeps on each.

A ``HostLauncher`` turns the host's own arguments (``inferlet_host.py``'s ``--control``, ``--engine``, ``--id``
...) into a running process and returns a ``HostProcess``: its pid, its exit code once it has one, ``wait()``,
``kill()`` and its stderr lines. ``LocalLauncher`` (the default) starts the host as a child of the server;
``cluster/host_actor.py`` starts it on another Ray node, beside its engine, through the same interface.

The launcher, not the pool, adds the interpreter, ``--parent`` (the process the host dies with: whoever
started it) and the environment, since those are the starting machine's.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from typing import Protocol

from .limits import HostLimits, host_env


def host_command(args: list[str], parent: int) -> list[str]:
    """The command line of a host started by process ``parent`` on this machine."""
    return [sys.executable, "-m", "pie_runtime.serve.inferlet_host", *args, "--parent", str(parent)]


class HostProcess(Protocol):
    pid: int

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...

    def lines(self) -> AsyncIterator[str]:
        """Its stderr, a line at a time, until it exits."""
        ...


class HostLauncher(Protocol):
    async def spawn(self, args: list[str], extra_env: dict[str, str], limits: HostLimits | None) -> HostProcess: ...


class LocalHostProcess:
    """A host that is the server's own child."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        return await self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()

    async def lines(self) -> AsyncIterator[str]:
        assert self.proc.stderr is not None  # PIPE
        async for line in self.proc.stderr:
            yield line.decode(errors="replace")


class LocalLauncher:
    async def spawn(self, args: list[str], extra_env: dict[str, str], limits: HostLimits | None) -> LocalHostProcess:
        proc = await asyncio.create_subprocess_exec(
            *host_command(args, os.getpid()),
            stdin=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=host_env(limits, extra_env),
        )
        return LocalHostProcess(proc)
