"""The fold: the one function that moves a working set's committed length over rows a fire wrote, wherever
the fold comes from (the fire's own count at commit, the epilogue's on the device, ``ws_fold``, the next
fire's ``settle``, or nothing when a fire fails) — docs/architecture.md, "The working set and its deferred fold".

For a model with KV pages only, folding n rows is bookkeeping: rows past them stay unfolded and the next fire
overwrites them. A model with recurrent state cannot leave rows out that way: its state has already advanced
through every row the fire ran. So each fire saves the state from before it (the slot's snapshot,
engine/state_slots.py), and a fold of n rows fewer than ran **restores the snapshot and replays the n folded
rows**: one more forward over n rows, run here, inline, so that the working set is consistent the moment
the fold returns (a fork, the next fire or a release may follow at once, and none of them need to know a
replay was owed). A hybrid's attention layers rewrite their K/V at those rows with the same values; those
pages are private to the working set (the fire's reservation copied any shared one).

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
from .working_set import WorkingSet


def apply_fold(sm: ServedModel, ws: WorkingSet, start: int, n: int) -> int:
    """Folds the first ``n`` rows of the fire that wrote ``ws`` from sequence index ``start``: ``committed``
    becomes ``start + n`` and the pages it filled are named for the prefix cache. With recurrent state, the
    state is brought to those ``n`` rows (restored, then replayed when fewer rows than ran). Returns the rows
    replayed (0 without recurrent state, or when every row that ran is folded)."""
    ws.committed = start + n
    replayed = 0
    hold, states = ws.state, sm.states
    if hold is not None and states is not None and hold.fire is not None:
        if n != hold.ran:
            sm.runner.restore_state(hold.slot)
            if n:
                segment = Segment(ws.pages, hold.start, n, state=hold.slot)
                sm.runner.forward([segment], hold.tokens[:n], hold.positions[:n])
                replayed = n
        states.end(hold)
        ws.replayed_rows += replayed
    sm.pages.commit(ws)
    return replayed
