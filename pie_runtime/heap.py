"""The process's heap: freed memory handed back to the system. glibc keeps the holes that freed blocks of a few
MiB leave between live ones resident (only its top is trimmed on free), so a load's or a warm-up's transients
would stay in the engine's RSS, and count in its peak, for as long as it runs."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

_trim: Callable[[int], int] | None | bool = None  # glibc's malloc_trim once looked up; False where there is none


def release_freed() -> None:
    """Hands the heap's free pages back (glibc's ``malloc_trim``; nothing under a C library without it)."""
    global _trim
    if _trim is None:
        name = ctypes.util.find_library("c")
        _trim = getattr(ctypes.CDLL(name), "malloc_trim", False) if name else False
    if _trim:
        _trim(0)  # type: ignore[operator]
