"""The fold: the one function that moves a working set's committed length over rows a fire wrote, wherever
the fold comes from (the fire's own count or path at commit, the epilogue's on the device, ``ws_fold``, the
next fire's ``settle``, or nothing when a fire fails) — docs/architecture.md, "The working set and its deferred
fold".

A fold commits a path of window rows (protocol.tree); a chain fold of n rows is the path ``[0 .. n-1]``. The
leading rows ``[0 .. n-1]`` are already where they belong; any other path's rows are moved into consecutive
rows first (``KVPages.move_rows``: K/V bytes, the runner's copy), so a committed sequence is always contiguous
rows ``0 .. committed-1``. For a model with KV pages only, that is all: rows past the fold stay unfolded and the
next fire overwrites them.

A model with recurrent state cannot leave rows out that way: its state has already advanced through every row
the fire ran. So each fire saves the state from before it (the slot's snapshot, engine/state_slots.py), and a
fold of n rows fewer than ran **restores the snapshot and replays the n folded rows**: one more forward over n
rows, run here, inline, so that the working set is consistent the moment the fold returns (a fork, the next
fire or a release may follow at once, and none of them need to know a replay was owed). A hybrid's attention
layers rewrite their K/V at those rows with the same values; those pages are private to the working set (the
fire's reservation copied any shared one). Tree fires on such a model are refused at admission
(fire_requests.py: a state runs through rows in order, not along branches), so its folds are always chains.

Replay against keeping a state per row (the choice, measured by examples/recurrent_replay_bench.py on a random
LFM2, hidden 512, 8 layers, fp32, 1 thread, a loaded 2-core machine): the replay of 2 kept rows costs about one
more pass (93 ms against a 74 ms plain step and a 104 ms 5-row round), while the 1 + k state copies a per-row
store would make cost 0.1..1.8 ms. Per-row states are cheaper in time; replay is what is built, because it is
exact by construction (the same forward over the same rows, for chunked fires, any fold, device folds and
failed forwards alike) and holds two states a sequence instead of 1 + k (Mamba: D x S floats a layer a row,
2.4 MB a row on a 130M model). The planner (inferlet.draft_length) prices the replay into a rejecting round;
per-row states are the next step where rejections are frequent.
"""

from __future__ import annotations

from ..models.context import Segment
from .served import ServedModel
from .working_set import TreeWindow, WorkingSet


def apply_fold(sm: ServedModel, ws: WorkingSet, start: int, path: list[int], tree: TreeWindow | None = None) -> int:
    """Commits window rows ``path`` (checked by ``protocol.tree.fold_path``) of the fire whose window starts at
    sequence index ``start``: they become rows ``start .. start+len(path)-1``, ``ws.committed`` ends there and
    the pages it filled are named for the prefix cache. With recurrent state (chain paths only), the state is
    brought to those rows (restored, then replayed when fewer rows than ran). Returns the rows replayed (0
    without recurrent state, or when every row that ran is folded)."""
    n = len(path)
    moves = [(start + row, start + i) for i, row in enumerate(path) if row != i]
    if moves:
        sm.pages.move_rows(ws, [src for src, _ in moves], [dst for _, dst in moves])
    if tree is not None and path:  # the folded rows now hold the path's tokens at their default positions
        sm.pages.wrote(ws, start, [tree.tokens[row] for row in path])
    ws.committed = start + n
    replayed = 0
    hold, states = ws.state, sm.states
    if hold is not None and states is not None and hold.fire is not None:
        assert not moves, "tree fires are refused on models with recurrent state"
        if n != hold.ran and 0 < n <= min(hold.keep, hold.ran):  # the state after row n-1, kept by the fire
            sm.runner.take_row_state(hold.slot, n - 1)
        elif n != hold.ran:
            sm.runner.restore_state(hold.slot)
            if n:
                segment = Segment(ws.pages, hold.start, n, state=hold.slot)
                sm.runner.forward([segment], hold.tokens[:n], hold.positions[:n])
                replayed = n
        states.end(hold)
        ws.replayed_rows += replayed
    sm.pages.commit(ws)
    return replayed


def settle_fold(sm: ServedModel, ws: WorkingSet, path: list[int]) -> int:
    """Settles ``ws``'s deferred fold with ``path`` (from ``WorkingSet.check_settle``); returns the rows
    replayed."""
    tree = ws.pending_tree
    ws.pending_fold, ws.pending_tree = None, None
    return apply_fold(sm, ws, ws.committed, path, tree)
