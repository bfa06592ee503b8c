"""The processes of a `pie serve` that examples/soak_serve.py measures: who listens on a port, a process's RSS
and open descriptors, its children and all its descendants (a sandboxed upload host is bwrap's child), the
server's tree by role, and those sampled over a run (first, last, largest, the last half's slope)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Proc:
    """One process's footprint."""

    pid: int
    rss_bytes: int
    open_fds: int


def listener_pid(port: int) -> int | None:
    """The pid holding the listening TCP socket on ``port`` (from /proc), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                    return int(entry.name)
            except OSError:
                continue
    return None


def footprint(pid: int) -> Proc | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss = next((int(line.split()[1]) << 10 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return Proc(pid, rss, fds)


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def label(pid: int) -> str:
    """A process's short name and pid, e.g. ``bwrap 812`` (a sandbox) or ``python 815`` (a host)."""
    try:
        return f"{Path(f'/proc/{pid}/comm').read_text().strip()} {pid}"
    except OSError:
        return f"? {pid}"


def tree(server_pid: int | None, engine_pid: int | None) -> tuple[dict[str, Proc], dict[str, Proc]]:
    """The server's processes: by role (``server``, ``engine``, ``hosts``: every other process below the
    server, summed; pid: the first's) and each one alone, by :func:`label` (the engine's descendants too:
    its tensor-parallel workers)."""
    roles: dict[str, Proc] = {}
    each: dict[str, Proc] = {}
    if engine_pid is not None and (fp := footprint(engine_pid)) is not None:
        roles["engine"] = each[f"engine {engine_pid}"] = fp
        for d in descendants(engine_pid):
            if (fp := footprint(d)) is not None:
                each[f"engine/{label(d)}"] = fp
    if server_pid is None:
        return roles, each
    if (fp := footprint(server_pid)) is not None:
        roles["server"] = each[f"server {server_pid}"] = fp
    below = [d for c in children(server_pid) if c != engine_pid for d in (c, *descendants(c))]
    hosts = [fp for p in below if (fp := footprint(p)) is not None]  # a sandboxed host is bwrap's child
    for fp in hosts:
        each[label(fp.pid)] = fp
    if hosts:  # summed: a restarted engine comes with new hosts
        roles["hosts"] = Proc(hosts[0].pid, sum(h.rss_bytes for h in hosts), sum(h.open_fds for h in hosts))
    return roles, each


@dataclass
class Series:
    """One role's RSS and descriptors sampled over a run: (seconds since the start, bytes, fds)."""

    points: list[tuple[float, int, int]]

    def summary(self) -> dict:
        """First, last and largest RSS (MiB) and fds, and the RSS slope over the last half (MiB a minute, by
        least squares; None with fewer than three points there)."""
        rss = [p[1] for p in self.points]
        fds = [p[2] for p in self.points]
        half = [p for p in self.points if p[0] >= self.points[-1][0] / 2]
        return {
            "rss_mib": {"first": _mib(rss[0]), "last": _mib(rss[-1]), "max": _mib(max(rss))},
            "fds": {"first": fds[0], "last": fds[-1], "max": max(fds)},
            "slope_mib_per_min_last_half": _slope(half),
            "samples": len(self.points),
        }


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


def _slope(points: list[tuple[float, int, int]]) -> float | None:
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(p[0] for p in points) / n
    mr = sum(p[1] for p in points) / n
    var = sum((p[0] - mt) ** 2 for p in points)
    if var == 0:
        return None
    return round(sum((p[0] - mt) * (p[1] - mr) for p in points) / var * 60 / 2**20, 2)


def summarize(
    start: dict[str, Proc], end: dict[str, Proc], samples: dict[str, list], seconds: float
) -> dict[str, dict]:
    """Each role's series (``samples``: role -> points), the snapshots at its ends: first, last, max, the last
    half's slope."""
    out = {}
    for role, a in start.items():
        points = [(0.0, a.rss_bytes, a.open_fds), *samples.get(role, [])]
        if (b := end.get(role)) is not None:
            points.append((max(seconds, points[-1][0]), b.rss_bytes, b.open_fds))
        out[role] = {**Series(points).summary(), "span_s": round(points[-1][0])}
    return out


async def engine_pid(client: httpx.AsyncClient) -> int | None:
    return ((await client.get("/health")).json().get("engine") or {}).get("pid")


async def sample(client: httpx.AsyncClient, server_pid: int | None, every: float, into: dict[str, list]) -> None:
    """Until cancelled: each role's (seconds since the start, RSS, fds) every ``every`` seconds."""
    began = time.monotonic()
    while True:
        await asyncio.sleep(every)
        with contextlib.suppress(httpx.HTTPError):  # an engine restarting: the next sample
            roles, _ = tree(server_pid, await engine_pid(client))
            for role, p in roles.items():
                into.setdefault(role, []).append((time.monotonic() - began, p.rss_bytes, p.open_fds))
