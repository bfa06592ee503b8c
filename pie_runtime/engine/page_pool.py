"""The KV page allocator: page handles and reference counts, no tensors (the bytes live in models/kv_cache).

A page whose count drops to zero is free, unless the prefix cache keeps it for its content (``keep``): then it
is *idle*, still counted free for admission, and handed out again only when no truly free page is left, least
recently released first (``on_evict`` tells the cache it is gone). ``share`` on an idle page revives it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ..protocol import ErrorCode, PieError


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages
        self._idle: OrderedDict[int, None] = OrderedDict()  # refcount-0 pages kept for content, LRU first
        self.keep: Callable[[int], bool] = lambda page: False
        self.on_evict: Callable[[int], None] = lambda page: None
        self.evictions = 0

    @property
    def free_pages(self) -> int:
        """Pages an allocation may take: the free ones and the idle (evictable) ones."""
        return len(self._free) + len(self._idle)

    @property
    def idle_pages(self) -> int:
        return len(self._idle)

    @property
    def used_pages(self) -> int:
        """Pages some working set holds."""
        return self.num_pages - self.free_pages

    def alloc(self, n: int) -> list[int]:
        if n > self.free_pages:
            raise PieError(
                ErrorCode.OUT_OF_PAGES, f"needs {n} KV pages, {self.free_pages} of {self.num_pages} are free"
            )
        pages = [self._free.pop() if self._free else self._evict() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def _evict(self) -> int:
        page, _ = self._idle.popitem(last=False)
        self.evictions += 1
        self.on_evict(page)
        return page

    def share(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] == 0:
                if p not in self._idle:
                    raise AssertionError(f"page {p} is free, not shareable")
                del self._idle[p]
            self._refs[p] += 1

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if self.keep(p):
                    self._idle[p] = None
                else:
                    self._free.append(p)
            elif self._refs[p] < 0:
                raise AssertionError(f"page {p} released twice")
