"""Applying a fold: the one function every fold of a working set goes through — a fire's fold fixed when it
was sent or chosen by its epilogue (step.py), a deferred fold settled by ``ws_fold`` (ws_requests.py) or by the
next fire's ``settle`` (fire_requests.py).

A fold commits a path of window rows (protocol.tree). The leading rows ``[0 .. n-1]`` are already where they
belong; any other path's rows are moved into consecutive rows first (``KVPages.move_rows``: K/V bytes, the
runner's copy), so a committed sequence is always contiguous rows ``0 .. committed-1``.
"""

from __future__ import annotations

from .kv_pages import KVPages
from .working_set import TreeWindow, WorkingSet


def apply_fold(pages: KVPages, ws: WorkingSet, start: int, path: list[int], tree: TreeWindow | None) -> None:
    """Commits window rows ``path`` (checked by ``protocol.tree.fold_path``) of the fire whose window starts at
    sequence index ``start``: they become rows ``start .. start+len(path)-1`` and ``ws.committed`` ends there."""
    moves = [(start + row, start + i) for i, row in enumerate(path) if row != i]
    if moves:
        pages.move_rows(ws, [src for src, _ in moves], [dst for _, dst in moves])
    if tree is not None and path:  # the folded rows now hold the path's tokens at their default positions
        pages.wrote(ws, start, [tree.tokens[row] for row in path])
    ws.committed = start + len(path)
    pages.commit(ws)


def settle_fold(pages: KVPages, ws: WorkingSet, path: list[int]) -> None:
    """Settles ``ws``'s deferred fold with ``path`` (from ``WorkingSet.check_settle``)."""
    tree = ws.pending_tree
    ws.pending_fold, ws.pending_tree = None, None
    apply_fold(pages, ws, ws.committed, path, tree)
