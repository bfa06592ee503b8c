"""The server's KV admission: a run starts only when the KV its working sets can grow to fits the engine's pool
beside the runs already in it; until then it waits (FIFO), instead of reaching the engine and failing there with
``out_of_pages``.

What a run can grow to is ``auth.kv_needed`` (pool pages across page groups, a sliding group's bounded by its
window), the bound the per-key quotas charge, so a model with KV page groups runs as many long sequences at once
as its pool holds with them (Gemma 3: about three times as many 4,000-token completions as with
``--kv-swa-full``). The capacity is the engine's pool (``ModelInfo.kv_bytes / page_bytes``); pages the prefix
cache keeps are the engine's to hand out again, so they do not count. A run whose bound alone exceeds the pool
is let in only when no other run holds pages: the engine then says what it can do with it (its prompt may be
cached, so the bound is not a refusal). With the gate off (``capacity`` None: several engines, or no pool) every
run goes straight on.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Waiter:
    pages: int
    ready: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class KVGate:
    """Pages admitted runs may hold in the engine's pool, and the runs waiting for theirs, first come first in."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.held = 0  # pages the admitted runs' bounds add up to
        self.admitted = 0  # runs holding pages
        self.most_admitted = 0  # the most runs that held pages at once (for operators and examples)
        self._waiting: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _fits(self, pages: int) -> bool:
        if self.capacity is None or self.admitted == 0:
            return True
        return self.held + pages <= self.capacity

    def _admit(self, pages: int) -> None:
        self.held += pages
        self.admitted += 1
        self.most_admitted = max(self.most_admitted, self.admitted)

    async def acquire(self, pages: int) -> None:
        """Returns once ``pages`` are the caller's (``release`` them after); cancellable while it waits."""
        if not self._waiting and self._fits(pages):
            self._admit(pages)
            return
        waiter = _Waiter(pages)
        self._waiting.append(waiter)
        try:
            await waiter.ready
        except BaseException:
            if waiter.ready.done() and not waiter.ready.cancelled():
                self.release(pages)  # admitted as it was cancelled: give the pages back
            else:
                self._waiting.remove(waiter)
                self._wake()  # a large waiter gone may let smaller ones behind it in
            raise

    def release(self, pages: int) -> None:
        self.held -= pages
        self.admitted -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._fits(self._waiting[0].pages):
            waiter = self._waiting.popleft()
            self._admit(waiter.pages)
            waiter.ready.set_result(None)
