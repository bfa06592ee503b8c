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
