"""The page tables of working sets over one model's page pool (docs/architecture.md, "The working set").

A working set's pages cover its rows ``0 .. committed-1`` and whatever unfolded rows a fire has written past
them. Full pages may be shared between working sets after a fork; a page is copied (copy-on-write) the first
time a fire writes into it while shared. This module knows page handles and row counts, never tensors: the
copy itself is the ``copy_pages`` callback (the model runner's).
"""

from __future__ import annotations

from collections.abc import Callable

from .page_pool import PagePool
from .working_set import WorkingSet

CopyPages = Callable[[list[int], list[int]], None]  # (source pages, destination pages)


class KVPages:
    def __init__(self, pool: PagePool, page_size: int, copy_pages: CopyPages):
        self.pool = pool
        self.page_size = page_size
        self.copy_pages = copy_pages

    @property
    def total(self) -> int:
        return self.pool.num_pages

    @property
    def free(self) -> int:
        return self.pool.free_pages

    def pages_for(self, rows: int) -> int:
        return (rows + self.page_size - 1) // self.page_size

    def reserve(self, ws: WorkingSet, start: int, rows: int) -> None:
        """Makes rows ``start .. start+rows-1`` of ``ws`` writable: new pages past its table, and a private copy
        of every shared page those rows land in. All or nothing: OUT_OF_PAGES leaves ``ws`` as it was."""
        need = self.pages_for(start + rows)
        grow = max(0, need - len(ws.pages))
        shared = [
            i for i in range(start // self.page_size, min(need, len(ws.pages))) if self.pool.refcount(ws.pages[i]) > 1
        ]
        fresh = self.pool.alloc(grow + len(shared))
        if shared:
            src = [ws.pages[i] for i in shared]
            dst = fresh[grow:]
            self.copy_pages(src, dst)
            self.pool.release(src)
            for i, p in zip(shared, dst):
                ws.pages[i] = p
        ws.pages.extend(fresh[:grow])

    def fork(self, parent: WorkingSet) -> list[int]:
        """The page table of a fork of ``parent``: its committed pages, shared (the tail page too; the first
        fire of either side that writes into a shared page copies it)."""
        keep = parent.pages[: self.pages_for(parent.committed)]
        self.pool.share(keep)
        return list(keep)

    def trim(self, ws: WorkingSet) -> None:
        """Returns the pages past the committed length (they hold only unfolded rows)."""
        keep = self.pages_for(ws.committed)
        self.pool.release(ws.pages[keep:])
        del ws.pages[keep:]

    def release(self, ws: WorkingSet) -> None:
        self.pool.release(ws.pages)
        ws.pages = []
