"""The page tables of working sets over one model's page pool (docs/working-sets.md, "The working set").

A working set's pages cover its rows ``0 .. committed-1`` and whatever unfolded rows a fire has written past
them. Full pages may be shared between working sets after a fork, or through the prefix cache
(prefix_cache.py), which names full committed pages by their content so that a later working set maps them
instead of computing them again. A page is copied (copy-on-write) the first time a fire writes into it while
it is shared or named. This module knows page handles and row counts, never tensors: the copy itself is the
``copy_pages`` callback (the model runner's).

Page groups (models/kv_groups.py): a working set holds one table per group, every table over this one pool (a
page is any group's). A sliding group (window W) needs, of the committed rows, only those a later row attends:
rows ``committed - W + 1 ..``; as the committed length grows (``commit``) it lets go of every page below the
one that row lies in (one page of slack), so it holds about ``W / page_size + 1`` pages; a dropped page's entry
is -1. Unfolded rows and the window before the first of them are always held, so rejected drafts never need a
dropped row. The rules per operation: ``fork`` shares each group's held pages; ``trim`` and ``release`` work per
group; ``truncate`` back to rows a sliding group already let go of is refused (their K/V are gone);
``evict`` compacts every group's rows alike, and a sliding layer attends the last W rows of the compacted
working set (sequence indices, as every layer's causal mask: context.py), so an eviction that would pull into
that window a row the group has let go of is refused. The prefix cache names group 0's pages and is served
only for models of one group (engine/core.py): a sliding group's hit would need the last W rows of the prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..models.kv_groups import window_span
from ..protocol import ErrorCode, PieError
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
    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        copy_pages: CopyPages,
        copy_slots: CopySlots | None = None,
        windows: Sequence[int | None] = (None,),
    ):
        self.pool = pool
        self.page_size = page_size
        self.windows = tuple(windows)  # per page group: the rows its tables keep (None: every row)
        self.chunk_rows = 256  # the most rows of one fire a forward runs (the engine's max_batch_tokens)
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

    def empty_tables(self) -> list[list[int]]:
        """The tables of a new working set: one empty table per page group."""
        return [[] for _ in self.windows]

    def held(self, ws: WorkingSet) -> int:
        """Pages ``ws`` holds, every group's."""
        return sum(len(table) - table.count(-1) for table in ws.tables)

    def held_per_group(self, ws: WorkingSet) -> list[int]:
        return [len(table) - table.count(-1) for table in ws.tables]

    def window_span(self, window: int) -> int:
        """Rows of a fire a sliding group reserves pages for when its pages move along the fire (``advance``):
        the window and a chunk, with a page of slack at either end and the fire's first page."""
        return window_span(window, self.chunk_rows, self.page_size)

    def reserve(self, ws: WorkingSet, start: int, rows: int, moving: bool = False) -> None:
        """Makes rows ``start .. start+rows-1`` of ``ws`` writable in every page group: new pages past each table,
        and a private copy of every shared or named page those rows land in. All or nothing: OUT_OF_PAGES leaves
        ``ws`` as it was. ``moving`` (a fire that folds every row it runs): a sliding group reserves pages for
        the first ``window_span`` rows only, and ``advance`` moves them along as the fire's chunks run, so a
        long prompt holds about a window and a chunk of sliding pages, never the whole prompt's."""
        need = self.pages_for(start + rows)
        plans = []
        for table, window in zip(ws.tables, self.windows):
            stop = need
            if moving and window is not None and rows > self.window_span(window):
                stop = self.pages_for(start + self.window_span(window))
            grow = max(0, stop - len(table))
            first = start // self.page_size
            shared = [i for i in range(first, min(need, len(table))) if table[i] >= 0 and self._frozen(table[i])]
            plans.append((grow, shared))
        fresh = self.pool.alloc(sum(grow + len(shared) for grow, shared in plans))
        for table, (grow, shared) in zip(ws.tables, plans):
            mine, fresh = fresh[: grow + len(shared)], fresh[grow + len(shared) :]
            if shared:
                src = [table[i] for i in shared]
                dst = mine[grow:]
                self.copy_pages(src, dst)
                self.pool.release(src)
                for i, p in zip(shared, dst):
                    table[i] = p
            table.extend(mine[:grow])
            table.extend([-1] * (need - len(table)))  # a moving fire's later pages: filled by ``advance``

    def advance(self, ws: WorkingSet, fire_start: int, first: int, stop: int) -> None:
        """Before a forward runs rows ``first .. stop-1`` of a fire that starts at row ``fire_start``: every page
        group holds a page for each row from the window's first (``first - W + 1``) to ``stop - 1``. A sliding
        group's pages of the fire's rows that left the window are moved to the rows ahead (a moving fire's,
        ``reserve``); any page still missing comes from the pool."""
        ps = self.page_size
        for table, window in zip(ws.tables, self.windows):
            if window is None:
                continue
            lo = max(0, first - window + 1) // ps
            want = [j for j in range(lo, self.pages_for(stop)) if table[j] < 0]
            if not want:
                continue
            # pages wholly of this fire's rows, below the window: no later row attends them (the fire folds all)
            spare = [j for j in range(self.pages_for(fire_start), lo) if table[j] >= 0]
            moved = spare[: len(want)]
            fresh = self.pool.alloc(len(want) - len(moved))
            for j, page in zip(want, [table[i] for i in moved] + fresh):
                table[j] = page
            for i in moved:
                table[i] = -1

    def slide(self, ws: WorkingSet) -> None:
        """Each sliding group lets go of the pages below the one holding row ``committed - W + 1`` (module
        docstring): no later row attends their rows."""
        for table, window in zip(ws.tables, self.windows):
            if window is None:
                continue
            below = max(0, ws.committed - window + 1) // self.page_size
            gone = [p for p in table[:below] if p >= 0]
            if gone:
                self.pool.release(gone[::-1])
                table[:below] = [-1] * below

    def group_slots(self, ws: WorkingSet, rows: range) -> list[list[int]]:
        """The slots of ``rows`` in each page group's table; -1 for a row its group no longer holds."""
        ps = self.page_size
        return [
            [
                table[r // ps] * ps + r % ps if table[r // ps] >= 0 and (w is None or r >= ws.held_from) else -1
                for r in rows
            ]
            for table, w in zip(ws.tables, self.windows)
        ]

    def held_from(self, ws: WorkingSet) -> list[int]:
        """Per page group, the first row whose K/V it holds (0 for a group that keeps every row)."""
        ps = self.page_size
        out = []
        for table, window in zip(ws.tables, self.windows):
            first = next((j for j, p in enumerate(table) if p >= 0), len(table))
            out.append(0 if window is None else min(max(first * ps, ws.held_from), ws.committed))
        return out

    def slots(self, pages: Sequence[int], rows: Iterable[int]) -> list[int]:
        """The pool slots of ``rows`` of a sequence whose page table is ``pages``."""
        ps = self.page_size
        return [pages[r // ps] * ps + r % ps for r in rows]

    def move_rows(self, ws: WorkingSet, src: list[int], dst: list[int]) -> None:
        """Copies the K/V of rows ``src`` of ``ws`` onto rows ``dst`` (a tree fold's path, engine/fold.py). Every
        destination lies past the committed rows, in pages the fire that wrote them reserved (private)."""
        if self.copy_slots is None:
            raise RuntimeError("this KVPages was built without a copy_slots callback")
        # every group's pages at once: a page's storage layers are all its group's
        self.copy_slots(
            [x for table in ws.tables for x in self.slots(table, src)],
            [x for table in ws.tables for x in self.slots(table, dst)],
        )

    def map_prefix(self, ws: WorkingSet, tokens: Sequence[int], max_rows: int) -> int:
        """Maps the longest cached chain over ``tokens`` (at most ``max_rows`` rows) into the empty page table of
        ``ws``, shared; returns the rows it covers (a multiple of the page size; 0 without a cache)."""
        if self.cache is None or ws.pages or ws.committed:
            return 0
        assert len(ws.tables) == 1, "the prefix cache serves models of one page group (engine/core.py)"
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
        """Names the pages ``ws``'s committed length has just made full; sliding groups let go of the pages that
        left their window."""
        if self.cache is not None:
            self.cache.register(ws.chain, ws.pages, ws.committed)
        self.slide(ws)

    def fork(self, parent: WorkingSet) -> list[list[int]]:
        """The page tables of a fork of ``parent``: each group's committed pages, shared (the tail page too; the
        first fire of either side that writes into a shared page copies it)."""
        tables = [table[: self.pages_for(parent.committed)] for table in parent.tables]
        self.pool.share([p for table in tables for p in table if p >= 0])
        return tables

    def trim(self, ws: WorkingSet) -> None:
        """Returns the pages past the committed length (they hold only unfolded rows)."""
        keep = self.pages_for(ws.committed)
        for table in ws.tables:
            self.pool.release([p for p in table[keep:][::-1] if p >= 0])
            del table[keep:]

    def check_window(self, ws: WorkingSet, rows: int, row_of=None) -> None:
        """Refuses (UNSUPPORTED) an edit after which ``ws`` keeps ``rows`` rows, new row ``i`` holding old row
        ``row_of(i)`` (itself by default), when a sliding group would need a row it has let go of."""
        ps = self.page_size
        for table, window in zip(ws.tables, self.windows):
            if window is None:
                continue
            for i in range(max(0, rows - window + 1), rows):
                old = i if row_of is None else row_of(i)
                if table[old // ps] < 0 or old < ws.held_from:
                    raise PieError(
                        ErrorCode.UNSUPPORTED,
                        f"working set {ws.id}: its sliding layers (window {window}) would attend row {old}, which "
                        "they no longer hold (the rows before their window are let go as it moves); serve the "
                        "model with --kv-swa-full to keep every row",
                    )

    def truncate(self, ws: WorkingSet, rows: int) -> None:
        """Drops the committed rows past ``rows``; the pages past it lose their names in ``ws``'s chain. Refused
        when a sliding group has let go of a row the truncated working set's window needs."""
        self.check_window(ws, rows)
        ws.committed = rows
        ws.chain.cut(rows, self.page_size)
        self.trim(ws)

    def evict(self, ws: WorkingSet, drop: set[int]) -> int:
        """Drops the committed rows ``drop`` of ``ws`` and closes the gaps: kept row ``keep[i]`` becomes row ``i``,
        in every page group. A page of a new table whose rows are one old page's, in place, is that page (no
        copy: dropping whole pages moves nothing); any other page is assembled in a fresh page from the kept
        rows' slots, so a page shared with a fork or named by the prefix cache is never written. A sliding group
        assembles only the pages of its new window (module docstring; refused when that window needs a row it let
        go of). Old pages no new row lives in go back to the pool. Returns the pages freed."""
        ps = self.page_size
        keep = [r for r in range(ws.committed) if r not in drop]
        self.check_window(ws, len(keep), lambda i: keep[i])
        first = min(drop)
        plans = [self._compact(table, keep, first, window) for table, window in zip(ws.tables, self.windows)]
        fresh = self.pool.alloc(sum(len(assemble) for _, assemble in plans))  # OUT_OF_PAGES: ws as it was
        src: list[int] = []
        dst: list[int] = []
        gone_total = 0
        for g, (table, assemble) in enumerate(plans):
            old = ws.tables[g]
            mine, fresh = fresh[: len(assemble)], fresh[len(assemble) :]
            for j, page in zip(assemble, mine):
                table[j] = page
                held = [(t, r) for t, r in enumerate(keep[j * ps : (j + 1) * ps]) if old[r // ps] >= 0]
                src += self.slots(old, [r for _, r in held])
                dst += [page * ps + t for t, _ in held]
            kept = set(table)
            gone = [p for p in old if p >= 0 and p not in kept]
            self.pool.release(gone[::-1])
            gone_total += len(gone) - len(mine)
            ws.tables[g] = table
        if src:
            if self.copy_slots is None:
                raise RuntimeError("this KVPages was built without a copy_slots callback")
            self.copy_slots(src, dst)
        ws.chain.wrote(first, None, ps)  # the rows from the first dropped one are no prefix any more
        ws.committed, ws.dropped = len(keep), ws.dropped + len(drop)
        ws.held_from = sum(r < ws.held_from for r in keep)
        self.slide(ws)
        self.edits.evicted_rows += len(drop)
        self.edits.evicted_pages += gone_total
        return gone_total

    def _compact(self, old: list[int], keep: list[int], first: int, window: int | None) -> tuple[list[int], list[int]]:
        """One group's new table after an eviction keeping rows ``keep`` (the first dropped row ``first``), with
        -1 where a page is to be assembled or, in a sliding group, lies below the new window; and the indices of
        the pages to assemble."""
        ps = self.page_size
        below = 0 if window is None else max(0, len(keep) - window + 1) // ps
        table = list(old[: first // ps])  # pages before the first dropped row are untouched
        assemble: list[int] = []  # new page indices to fill from slots
        for j in range(first // ps, self.pages_for(len(keep))):
            rows = keep[j * ps : (j + 1) * ps]
            q = rows[0] // ps
            if j < below:
                table.append(-1)
            elif all(r == q * ps + t for t, r in enumerate(rows)) and old[q] >= 0:
                table.append(old[q])
            else:
                table.append(-1)
                assemble.append(j)
        return table, assemble

    def release(self, ws: WorkingSet) -> None:
        # the tail first: of a released chain, its last pages become idle first and so are evicted first,
        # which keeps the shared heads (system prompts) longest
        for g, table in enumerate(ws.tables):
            self.pool.release([p for p in table[::-1] if p >= 0])
            ws.tables[g] = []
