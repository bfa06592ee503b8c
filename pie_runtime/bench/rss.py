"""Resident memory of a process, read from Linux's /proc: the peak (VmHWM, the high-water mark of its RSS) and
the current resident set (VmRSS)."""

from __future__ import annotations

from pathlib import Path


def peak_rss_mib(pid: int | str = "self") -> float | None:
    """The process's peak RSS in MiB, or None where /proc has no such process (or no VmHWM line)."""
    return _status_mib(pid, "VmHWM")


def rss_mib(pid: int | str = "self") -> float | None:
    """The process's RSS now, in MiB (None as for :func:`peak_rss_mib`)."""
    return _status_mib(pid, "VmRSS")


def _status_mib(pid: int | str, field: str) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024  # kB
    return None


def tree_pids(root: int) -> list[int]:
    """``root`` and every process below it (children, their children, ...), read from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


class TreePeak:
    """The peak of a process tree's summed RSS, sampled every ``interval`` seconds on a thread from ``start()``
    to ``stop()`` (a sum of each process's VmHWM would overstate it: the processes peak at different times)."""

    def __init__(self, root: int, interval: float = 0.2):
        import threading

        self.root = root
        self.interval = interval
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> float:
        now = sum(rss_mib(pid) or 0.0 for pid in tree_pids(self.root))
        self.peak_mib = max(self.peak_mib, now)
        return now

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> TreePeak:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak_mib
