"""The fold: the one function that moves a working set's committed length over rows a fire wrote, wherever
the fold comes from (the fire's own count or path at commit, the epilogue's on the device, ``ws_fold``, the
next fire's ``settle``, or nothing when a fire fails) — docs/working-sets.md, "The working set and its deferred
fold".

A fold commits a path of window rows (protocol.tree); a chain fold of n rows is the path ``[0 .. n-1]``. The
leading rows ``[0 .. n-1]`` are already where they belong; any other path's rows are moved into consecutive
rows first (``KVPages.move_rows``: K/V bytes, the runner's copy), so a committed sequence is always contiguous
rows ``0 .. committed-1``. For a model with KV pages only, that is all: rows past the fold stay unfolded and the
next fire overwrites them.

A model with recurrent state cannot leave rows out that way: its state has already advanced through every row
the fire ran. Each fire saves the state from before it (the slot's snapshot, engine/state_slots.py). A fold of
n rows fewer than ran then brings the state to row n in one of two ways, chosen by the engine's
``--recurrent-fold``:

- **per-row** (the default): a fire whose fold may keep fewer rows than it runs (deferred, or a count below
  its rows) keeps the state after each of its first rows, up to ``--per-row-states`` (8), in its slot's per-row
  entries (models/state_cache.py). The layers have those states at hand: a short convolution's is the last
  K-1 inputs at that row, a slice of the inputs it concatenates anyway; a selective scan's is its h after
  that step, which it computes anyway (models/recurrent.py). A fold of n <= kept rows copies the state after row n-1
  into the live one: no forward (the approach SGLang and vLLM take to verify drafts on Mamba layers).
- **replay** (and the fallback for a fold of more rows than were kept, or a fire that kept none):
  **restore the snapshot and replay the n folded rows**, one more forward over n rows.

Either runs here, inline, so that the working set is consistent the moment the fold returns (a fork, the next
fire or a release may follow at once, and none of them need to know a replay was owed). A fold of 0 rows (a
failed fire) restores the snapshot. Per-row states survive a fire split into several chunks (each chunk keeps
its own rows' states) and a forward retried after a failure (the retry runs the fire's rows again from the
snapshot and keeps them again). A hybrid's attention layers need neither: their K/V rows past the fold stay
unfolded as for any model (under replay they are rewritten with the same values; the pages are private to
the working set: the fire's reservation copied any shared one). Tree fires on such a model are refused at
admission (fire_requests.py: a state runs through rows in order, not along branches), so folds are chains.

Why per-row is the default (measured by examples/recurrent_replay_bench.py; the table is in docs/performance.md,
"Recurrent state"): a rejecting round under replay costs one more pass, which raises the acceptance a round
needs well above a stateless model's; per-row states bring it back near stateless, for a kept-state write that
costs an accepting round little. Memory is the price: a working set holds 2 + ``--per-row-states`` states
instead of 2. Hence the default per-row, ``--per-row-states`` to bound it and ``--recurrent-fold replay`` where
memory is short. The
draft-length planner (inferlet.spec.draft_policy) prices a replay only for folds per-row states do not serve
(``ModelInfo.per_row_states``).
"""

from __future__ import annotations

from ..models.context import Segment
from .served import ServedModel
from .working_set import TreeWindow, WorkingSet


def apply_fold(served: ServedModel, ws: WorkingSet, start: int, path: list[int], tree: TreeWindow | None = None) -> int:
    """Commits window rows ``path`` (checked by ``protocol.tree.fold_path``) of the fire whose window starts at
    sequence index ``start``: they become rows ``start .. start+len(path)-1``, ``ws.committed`` ends there and
    the pages it filled are named for the prefix cache. With recurrent state (chain paths only), the state is
    brought to those rows (restored, then replayed when fewer rows than ran). Returns the rows replayed (0
    without recurrent state, or when every row that ran is folded)."""
    n = len(path)
    moves = [(start + row, start + i) for i, row in enumerate(path) if row != i]
    if moves:
        served.pages.move_rows(ws, [src for src, _ in moves], [dst for _, dst in moves])
    if tree is not None and path:  # the folded rows now hold the path's tokens at their default positions
        served.pages.wrote(ws, start, [tree.tokens[row] for row in path])
    ws.committed = start + n
    replayed = 0
    hold, states = ws.state, served.states
    if hold is not None and states is not None and hold.fire is not None:
        assert not moves, "tree fires are refused on models with recurrent state"
        if n != hold.ran and 0 < n <= min(hold.keep, hold.ran):  # the state after row n-1, kept by the fire
            served.runner.take_row_state(hold.slot, n - 1)
        elif n != hold.ran:
            served.runner.restore_state(hold.slot)
            if n:
                segment = Segment(ws.pages, hold.start, n, state=hold.slot)
                served.runner.forward([segment], hold.tokens[:n], hold.positions[:n])
                replayed = n
        states.end(hold)
        ws.replayed_rows += replayed
    served.pages.commit(ws)
    return replayed


def settle_fold(served: ServedModel, ws: WorkingSet, path: list[int]) -> int:
    """Settles ``ws``'s deferred fold with ``path`` (from ``WorkingSet.check_settle``); returns the rows
    replayed."""
    tree = ws.pending_tree
    ws.pending_fold, ws.pending_tree = None, None
    return apply_fold(served, ws, ws.committed, path, tree)
