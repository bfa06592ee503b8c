"""What a speculative round costs: the pass-cost model a draft-length policy plans with.

A round of k draft rows costs its rows' share of the engine's pass, the drafter's own work, a fixed overhead,
and on a model with recurrent state the replay of the rows it keeps after a rejection:

    round_cost(k) = step_share(k) + steps * draft_cost + overhead(k) + replay_cost(k)

Terms:
    pass-cost curve  ``pass_cost_ms[w-1]``: one sequence's pass of w rows, timed by the engine at start
                     (``Model.pass_cost_ms``); made non-decreasing (a dip timed on a busy machine would price a
                     wider pass below a narrower one) and extended linearly past its last width;
    load             the other sequences' rows in the engine step this run's last fire ran in (the fire reply's
                     ``step_rows``): under load a round is priced by what its rows add to the step,
                     pass_cost(load + 1 + k) - pass_cost(load), so speculation does not slow a busy server;
    overhead         what a round's wall time leaves unexplained by the curve and the drafting (the engine's
                     bookkeeping, the messages, verification on the host, attention over a longer context): the
                     median of the last ``OVERHEAD_ROUNDS`` residuals, kept apart for rounds that verified drafts
                     and plain ones (a drafting round costs more than the curve says, a plain one less so); a
                     residual may be negative, down to ``MAX_DISCOUNT`` of a 1-row pass, where the curve overstates
                     a pass;
    replay           with recurrent state (Mamba, LFM2) a rejection restores the state from before the round and
                     replays the kept rows (engine/fold.py), one more pass, unless a per-row state serves the fold
                     (``free_fold_rows``): P(replay) * pass_cost(E[rows kept | a replay]).
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Sequence

OVERHEAD_ROUNDS = 15  # rounds whose median residual is the overhead: a slow spell moves it, one pause does not
# The most a measured residual may take off the curve's price of a pass, as a share of a 1-row pass: the curve
# may overstate every pass (timed at start on a busy machine), but a round never costs nothing.
MAX_DISCOUNT = 0.5
# The least a round is priced at: under load on a flat stretch of the curve, with no overhead measured and a
# drafter that costs nothing (a lookup), a round adds nothing to its step, and rates would divide by it.
MIN_ROUND_MS = 1e-3


class PassCostModel:
    """Prices one run's rounds in ms (module docstring); learns its overhead and load from timed rounds."""

    def __init__(
        self,
        pass_cost_ms: Sequence[float],
        draft_cost_ms: float = 0.0,
        *,
        overhead_ms: float = 1.0,
        replay: bool = False,
        free_fold_rows: int = 0,
    ):
        self.costs = list(itertools.accumulate(pass_cost_ms, max))
        self.draft_cost_ms = draft_cost_ms
        self.overhead_ms = overhead_ms  # the prior, until a drafting round is timed
        self.residuals: deque[float] = deque(maxlen=OVERHEAD_ROUNDS)  # of rounds that verified drafts
        self.plain_residuals: deque[float] = deque(maxlen=OVERHEAD_ROUNDS)  # of rounds that verified none
        self.load = 0
        self.replay = replay  # a rejecting round replays its kept rows (recurrent state)
        self.free_fold_rows = free_fold_rows  # ... unless they are this many or fewer (per-row states)

    @property
    def measured(self) -> bool:
        """Whether there is a curve to price with (the engine measured one)."""
        return bool(self.costs)

    def pass_cost(self, rows: int) -> float:
        """ms of a ``rows``-row pass; extended linearly past the measured widths."""
        c = self.costs
        if rows <= len(c):
            return c[rows - 1]
        slope = c[-1] - c[-2] if len(c) >= 2 else c[-1]
        return c[-1] + slope * (rows - len(c))

    def step_share(self, drafts: int) -> float:
        """ms a round's rows (``last`` and ``drafts`` draft rows) add to a pass that carries ``load`` other rows."""
        return self.pass_cost(self.load + 1 + drafts) - (self.pass_cost(self.load) if self.load else 0.0)

    def overhead(self, k: int) -> float:
        """ms a round of k drafts costs past the curve's pass and the drafting: a drafting round's measured
        overhead, or a plain round's once one is timed."""
        measured = statistics.median(self.plain_residuals) if k == 0 and self.plain_residuals else self.overhead_ms
        # a discount says the curve overstates a pass alone; under load a round is priced by its share of the step
        return max(0.0, measured) if self.load else measured

    def replay_cost(self, alphas: Sequence[float]) -> float:
        """Expected ms of the replay a round of ``len(alphas)`` drafts causes, ``alphas[i]`` the acceptance of
        draft i+1 given 1..i kept: 0 without recurrent state or drafts, or where per-row states serve the fold."""
        if not self.replay or not alphas:
            return 0.0
        survive, p_reject, kept_if_rejected = 1.0, 0.0, 0.0
        for i, alpha in enumerate(alphas):  # draft i+1 rejected after i kept: the replay runs `last` and i drafts
            reject = survive * (1 - alpha)
            if 1 + i > self.free_fold_rows:  # fewer kept rows are a per-row state's copy, no pass
                p_reject += reject
                kept_if_rejected += reject * (1 + i)
            survive *= alpha
        if p_reject <= 0:
            return 0.0
        return p_reject * self.pass_cost(max(1, round(kept_if_rejected / p_reject)))

    def round_cost(self, k: int, steps: int | None = None, alphas: Sequence[float] = ()) -> float:
        """ms a round of k draft rows adds, with ``steps`` draft steps (default k); ``alphas`` (the drafts'
        acceptance, ``replay_cost``) matter only with recurrent state."""
        drafting = (k if steps is None else steps) * self.draft_cost_ms
        return max(MIN_ROUND_MS, self.step_share(k) + drafting + self.overhead(k) + self.replay_cost(alphas))

    def observe_load(self, step_rows: int, own_rows: int) -> None:
        """The engine ran this run's last fire (``own_rows`` rows) in a step of ``step_rows`` rows."""
        self.load = max(0, step_rows - own_rows)

    def observe_time(self, elapsed_ms: float, step_rows: int, steps: int) -> bool | None:
        """A round took ``elapsed_ms`` of wall time (from the end of the last round to the end of its own) in a
        step of ``step_rows`` rows, its own included, after ``steps`` draft steps: keeps its residual. Returns
        whether it was a plain round (no draft rows), None without a curve (nothing is learnt then)."""
        if not self.measured:
            return None
        residual = elapsed_ms - self.pass_cost(max(1, step_rows)) - steps * self.draft_cost_ms
        residual = max(-MAX_DISCOUNT * self.costs[0], residual)
        plain = step_rows - self.load <= 1  # no draft rows (a head's chain, if any, is priced above)
        (self.plain_residuals if plain else self.residuals).append(residual)
        if not plain:
            self.overhead_ms = statistics.median(self.residuals)
        return plain
