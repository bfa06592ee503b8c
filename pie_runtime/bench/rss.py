"""Peak resident memory of a process, read from Linux's /proc (VmHWM: the high-water mark of its RSS)."""

from __future__ import annotations

from pathlib import Path


def peak_rss_mib(pid: int | str = "self") -> float | None:
    """The process's peak RSS in MiB, or None where /proc has no such process (or no VmHWM line)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    return None
