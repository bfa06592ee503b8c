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

Replay against keeping a state per row: a per-row store would make a fold a copy instead of a forward, but
the scan would have to write out every row's state of every layer (Mamba: D x S floats a layer a row, where the
replay recomputes only the accepted rows) and each sequence would hold 1 + k states instead of 2. Measured on
a random LFM2 (hidden 512, 8 layers, examples/recurrent_replay_bench.py), the replay of a 2..4-row prefix
costs about one 1..4-row pass, which the planner (inferlet.draft_length) prices into a rejecting round.
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
