"""The page tables of working sets over one model's page pool (docs/architecture.md, "The working set").

A working set's pages cover its rows ``0 .. committed-1`` and whatever unfolded rows a fire has written past
them. Full pages may be shared between working sets after a fork, or through the prefix cache
(prefix_cache.py), which names full committed pages by their content so that a later working set maps them
instead of computing them again. A page is copied (copy-on-write) the first time a fire writes into it while
it is shared or named. This module knows page handles and row counts, never tensors: the copy itself is the
``copy_pages`` callback (the model runner's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .page_pool import PagePool
from .prefix_cache import PageChain, PrefixCache
from .working_set import WorkingSet

CopyPages = Callable[[list[int], list[int]], None]  # (source pages, destination pages)
CopySlots = Callable[[list[int], list[int]], None]  # (source slots, destination slots): page * page_size + offset


@dataclass
class KVEdits:
    """Running totals of the edits of this pool's working sets (the engine's ``stats``, ``/metrics``)."""

    evicted_rows: int = 0
    evicted_pages: int = 0  # pages evictions gave back to the pool (net of the fresh pages they assembled)
    restored_working_sets: int = 0
    restored_rows: int = 0

    def restored(self, start: int, rows: int) -> None:
        """``rows`` saved rows appended at row ``start``: a restore when they are the working set's first."""
        self.restored_working_sets += start == 0 and rows > 0
        self.restored_rows += rows


class KVPages:
    def __init__(self, pool: PagePool, page_size: int, copy_pages: CopyPages, copy_slots: CopySlots | None = None):
        self.pool = pool
        self.page_size = page_size
        self.copy_pages = copy_pages
        self.copy_slots = copy_slots
        self.cache: PrefixCache | None = None
        self.edits = KVEdits()

    def enable_prefix_cache(self, model: str) -> None:
        """Names full committed pages from now on, and lets a first fire reuse them (``map_prefix``)."""
        if self.cache is None:
            self.cache = PrefixCache(self.pool, self.page_size, model)

    @property
    def total(self) -> int:
        return self.pool.num_pages

    @property
    def free(self) -> int:
        """Pages a reserve may take, idle cached pages included (they are evicted on demand)."""
        return self.pool.free_pages

    @property
    def used(self) -> int:
        return self.pool.used_pages

    def pages_for(self, rows: int) -> int:
        return (rows + self.page_size - 1) // self.page_size

    def _frozen(self, page: int) -> bool:
        """A page another holder reads, or one the prefix cache names: never written in place."""
        return self.pool.refcount(page) > 1 or (self.cache is not None and self.cache.holds(page))

    def reserve(self, ws: WorkingSet, start: int, rows: int) -> None:
        """Makes rows ``start .. start+rows-1`` of ``ws`` writable: new pages past its table, and a private copy
        of every shared or named page those rows land in. All or nothing: OUT_OF_PAGES leaves ``ws`` as it was."""
        need = self.pages_for(start + rows)
        grow = max(0, need - len(ws.pages))
        shared = [i for i in range(start // self.page_size, min(need, len(ws.pages))) if self._frozen(ws.pages[i])]
        fresh = self.pool.alloc(grow + len(shared))
        if shared:
            src = [ws.pages[i] for i in shared]
            dst = fresh[grow:]
            self.copy_pages(src, dst)
            self.pool.release(src)
            for i, p in zip(shared, dst):
                ws.pages[i] = p
        ws.pages.extend(fresh[:grow])

    def slots(self, pages: Sequence[int], rows: Iterable[int]) -> list[int]:
        """The pool slots of ``rows`` of a sequence whose page table is ``pages``."""
        ps = self.page_size
        return [pages[r // ps] * ps + r % ps for r in rows]

    def move_rows(self, ws: WorkingSet, src: list[int], dst: list[int]) -> None:
        """Copies the K/V of rows ``src`` of ``ws`` onto rows ``dst`` (a tree fold's path, engine/fold.py). Every
        destination lies past the committed rows, in pages the fire that wrote them reserved (private)."""
        if self.copy_slots is None:
            raise RuntimeError("this KVPages was built without a copy_slots callback")
        self.copy_slots(self.slots(ws.pages, src), self.slots(ws.pages, dst))

    def map_prefix(self, ws: WorkingSet, tokens: Sequence[int], max_rows: int) -> int:
        """Maps the longest cached chain over ``tokens`` (at most ``max_rows`` rows) into the empty page table of
        ``ws``, shared; returns the rows it covers (a multiple of the page size; 0 without a cache)."""
        if self.cache is None or ws.pages or ws.committed:
            return 0
        keys, pages = self.cache.lookup(tokens, max_rows, ws.chain.root)
        self.pool.share(pages)
        ws.pages = list(pages)
        rows = len(pages) * self.page_size
        ws.chain = PageChain(list(tokens[:rows]), keys, ws.chain.root)
        return rows

    def wrote(self, ws: WorkingSet, start: int, tokens: Sequence[int] | None) -> None:
        """Rows ``start ..`` of ``ws`` now hold ``tokens`` (None: rows the cache cannot name). Rows written after
        an eviction sit at positions other than their index, so the cache names none of them."""
        if self.cache is not None:
            ws.chain.wrote(start, tokens if not ws.dropped else None, self.page_size)

    def commit(self, ws: WorkingSet) -> None:
        """Names the pages ``ws``'s committed length has just made full."""
        if self.cache is not None:
            self.cache.register(ws.chain, ws.pages, ws.committed)

    def fork(self, parent: WorkingSet) -> list[int]:
        """The page table of a fork of ``parent``: its committed pages, shared (the tail page too; the first
        fire of either side that writes into a shared page copies it)."""
        keep = parent.pages[: self.pages_for(parent.committed)]
        self.pool.share(keep)
        return list(keep)

    def trim(self, ws: WorkingSet) -> None:
        """Returns the pages past the committed length (they hold only unfolded rows)."""
        keep = self.pages_for(ws.committed)
        self.pool.release(ws.pages[keep:][::-1])
        del ws.pages[keep:]

    def truncate(self, ws: WorkingSet, rows: int) -> None:
        """Drops the committed rows past ``rows``; the pages past it lose their names in ``ws``'s chain."""
        ws.committed = rows
        ws.chain.cut(rows, self.page_size)
        self.trim(ws)

    def evict(self, ws: WorkingSet, drop: set[int]) -> int:
        """Drops the committed rows ``drop`` of ``ws`` and closes the gaps: kept row ``keep[i]`` becomes row ``i``.
        A page of the new table whose rows are one old page's, in place, is that page (no copy: dropping whole
        pages moves nothing); any other page is assembled in a fresh page from the kept rows' slots, so a page
        shared with a fork or named by the prefix cache is never written. Old pages no new row lives in go back
        to the pool. Returns the pages freed."""
        ps, old = self.page_size, ws.pages
        keep = [r for r in range(ws.committed) if r not in drop]
        first = min(drop)
        table = list(old[: first // ps])  # pages before the first dropped row are untouched
        assemble: list[int] = []  # new page indices to fill from slots
        for j in range(first // ps, self.pages_for(len(keep))):
            rows = keep[j * ps : (j + 1) * ps]
            q = rows[0] // ps
            if all(r == q * ps + t for t, r in enumerate(rows)):
                table.append(old[q])
            else:
                table.append(-1)
                assemble.append(j)
        fresh = self.pool.alloc(len(assemble))  # OUT_OF_PAGES here leaves ws as it was
        src: list[int] = []
        dst: list[int] = []
        for j, page in zip(assemble, fresh):
            table[j] = page
            rows = keep[j * ps : (j + 1) * ps]
            src += self.slots(old, rows)
            dst += range(page * ps, page * ps + len(rows))
        if src:
            if self.copy_slots is None:
                raise RuntimeError("this KVPages was built without a copy_slots callback")
            self.copy_slots(src, dst)
        kept = set(table)
        gone = [p for p in old if p not in kept]
        self.pool.release(gone[::-1])
        ws.pages = table
        ws.chain.wrote(first, None, ps)  # the rows from the first dropped one are no prefix any more
        ws.committed, ws.dropped = len(keep), ws.dropped + len(drop)
        self.edits.evicted_rows += len(drop)
        self.edits.evicted_pages += len(gone) - len(fresh)
        return len(gone) - len(fresh)

    def release(self, ws: WorkingSet) -> None:
        # the tail first: of a released chain, its last pages become idle first and so are evicted first,
        # which keeps the shared heads (system prompts) longest
        self.pool.release(ws.pages[::-1])
        ws.pages = []
