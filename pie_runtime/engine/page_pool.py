"""The KV page allocator: page handles and reference counts, no tensors (the bytes live in models/kv_cache)."""

from __future__ import annotations

from ..protocol import ErrorCode, PieError


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PieError(
                ErrorCode.OUT_OF_PAGES, f"needs {n} KV pages, {len(self._free)} of {self.num_pages} are free"
            )
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] += 1

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
            elif self._refs[p] < 0:
                raise AssertionError(f"page {p} released twice")
