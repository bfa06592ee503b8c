"""Objects shared by the inferlet runs of one process: ``Model.shared(key, make)``.

An inferlet host (``pie serve``'s workers) runs many runs of many inferlets in one process, as asyncio tasks;
``pie run`` runs one run in a process of its own. A run that wants state to outlive it and serve the next runs
(a cross-request suffix index, a compiled grammar, a table read from a file) asks for it by key:

    index = model.shared("suffix", lambda: SuffixIndex(...))   # made by the first run that asks, then reused

The registry is a plain dict in this process, keyed by (model name, key): nothing crosses to another process or
host, and nothing reaches the engine. The object is "read-mostly": runs of one host run in one thread, so a run
may also update it between its awaits (the suffix index adds each run's output), but it must not hold it
half-updated across an ``await``. ``make`` runs once per key (under a lock, for hosts that use threads); the
object lives until the process ends or ``forget`` drops it. Keys name what the object is built from (a file's
path, a bound) when runs may ask for different ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_objects: dict[tuple[str, str], Any] = {}
_lock = threading.Lock()


def shared(model: str, key: str, make: Callable[[], T]) -> T:
    """The object shared under (``model``, ``key``) in this process; ``make()`` builds it on first use."""
    with _lock:
        if (model, key) not in _objects:
            _objects[(model, key)] = make()
        return _objects[(model, key)]


def forget(model: str | None = None, key: str | None = None) -> None:
    """Drops the shared objects of ``model`` and ``key`` (None: any); the next ``shared`` makes them anew."""
    with _lock:
        for m, k in list(_objects):
            if model in (None, m) and key in (None, k):
                del _objects[(m, k)]


def keys() -> list[tuple[str, str]]:
    """The (model, key) pairs shared now."""
    with _lock:
        return list(_objects)
