"""Resource limits and environment of an inferlet host process.

``HostLimits`` travels to the host on its command line as JSON, and the host applies it to itself
(``resource.setrlimit``, the hard limits too) before it connects to anything, so every inferlet it runs
lives under it. (Not in a ``preexec_fn``: forking a server with ZeroMQ's threads and then calling into libc
before exec can deadlock.) An address-space limit turns a memory blow-up
into a ``MemoryError`` (or the host's death); the CPU-seconds limit counts over the host's whole life, so a
host that used it up is killed by the kernel and restarted like any crashed host. ``clean_env`` starts the host
without the server's environment variables (API keys, tokens): the mode for uploaded code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import sys

from pydantic import BaseModel, ConfigDict, Field

_PR_SET_PDEATHSIG = 1


class HostLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    address_space_bytes: int | None = Field(default=None, gt=0)
    cpu_seconds: int | None = Field(default=None, gt=0)
    open_files: int | None = Field(default=None, gt=0)
    processes: int | None = Field(default=None, gt=0)  # RLIMIT_NPROC: processes and threads of the host's uid
    clean_env: bool = False  # start the host without the server's environment variables

    def rlimits(self) -> list[tuple[int, int, int]]:
        """(resource, soft, hard) for each limit that is set."""
        out = []
        if self.address_space_bytes is not None:
            out.append((resource.RLIMIT_AS, self.address_space_bytes, self.address_space_bytes))
        if self.cpu_seconds is not None:
            # SIGXCPU at the soft limit, SIGKILL one second later if it is caught
            out.append((resource.RLIMIT_CPU, self.cpu_seconds, self.cpu_seconds + 1))
        if self.open_files is not None:
            out.append((resource.RLIMIT_NOFILE, self.open_files, self.open_files))
        if self.processes is not None:
            out.append((resource.RLIMIT_NPROC, self.processes, self.processes))
        return out


def host_env(limits: HostLimits | None, extra: dict[str, str]) -> dict[str, str]:
    """The host's environment: the server's own, or with ``clean_env`` only what Python needs to start."""
    if limits is not None and limits.clean_env:
        base = {"PATH": os.defpath, "LANG": "C.UTF-8"}
    else:
        base = dict(os.environ)
    return {**base, **extra}


def apply(limits: HostLimits) -> None:
    """Sets this process's limits (the host calls it at start)."""
    for res, soft, hard in limits.rlimits():
        resource.setrlimit(res, (soft, hard))


def reap_strays() -> int:
    """Kills every process of this pid namespace but this one and its init (pid 1): what a run forked. Only
    for a host alone in a pid namespace of its own (the sandbox's). Returns how many it signalled."""
    me, killed = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (1, me):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
    for pid in killed:  # our own children wait here so no zombie keeps its slot (init reaps the others)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return len(killed)


def die_with_parent(parent_pid: int) -> None:
    """Asks the kernel to kill this process when its parent (the server) dies, even by SIGKILL: no host
    outlives its server. Exits at once when the parent is already gone."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
