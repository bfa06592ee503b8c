"""The pass-cost model alone: a round's price from the engine's curve, its share of a loaded step, the drafter's
steps, a measured overhead and, with recurrent state, the expected replay."""

from __future__ import annotations

import pytest

from inferlet.spec.pass_cost import MAX_DISCOUNT, MIN_ROUND_MS, PassCostModel

AMX_INT4 = [20.7, 22.6, 23.1, 24.8, 32.5, 32.5, 33.7, 34.8]
FLAT = [40.0] * 32
MTP_STEP_MS = 0.74


def test_costs_extend_past_the_measured_widths():
    c = PassCostModel([10.0, 12.0, 14.0])
    assert c.pass_cost(3) == 14.0 and c.pass_cost(5) == 18.0


def test_a_curve_timed_with_a_dip_never_prices_a_wider_pass_below_a_narrower_one():
    c = PassCostModel([10.0, 12.0, 11.0, 13.0])
    assert [c.pass_cost(w) for w in range(1, 6)] == [10.0, 12.0, 12.0, 13.0, 14.0]
    c.observe_load(step_rows=3, own_rows=1)  # load 2: its own row would otherwise cost -1 ms
    assert c.round_cost(0) == pytest.approx(c.overhead_ms)


def test_a_round_is_priced_by_its_rows_its_drafting_and_the_overhead():
    c = PassCostModel(AMX_INT4, MTP_STEP_MS, overhead_ms=2.0)
    assert c.round_cost(3) == pytest.approx(AMX_INT4[3] + 3 * MTP_STEP_MS + 2.0)
    assert c.round_cost(3, steps=1) == pytest.approx(AMX_INT4[3] + MTP_STEP_MS + 2.0)
    c.observe_load(step_rows=6, own_rows=2)  # 4 other rows: the round adds what its 4 rows add to the step
    assert c.load == 4 and c.step_share(3) == pytest.approx(AMX_INT4[7] - AMX_INT4[3])


def test_the_round_overhead_is_the_median_of_what_timed_rounds_leave_unexplained():
    c = PassCostModel(AMX_INT4, MTP_STEP_MS)
    assert c.overhead_ms == 1.0  # the prior, before any round is timed
    for elapsed in (32.0, 33.0, 31.5, 400.0, 32.5):  # 3-row rounds alone in their step; one stalled
        assert c.observe_time(elapsed, step_rows=3, steps=2) is False
    assert c.overhead_ms == pytest.approx(32.5 - 23.1 - 2 * MTP_STEP_MS)  # the stall does not move it
    fixed = PassCostModel([], MTP_STEP_MS)
    assert fixed.observe_time(50.0, step_rows=3, steps=2) is None and fixed.overhead_ms == 1.0


def test_plain_rounds_are_priced_apart():
    c = PassCostModel(AMX_INT4)
    assert c.observe_time(AMX_INT4[0] + 0.5, step_rows=1, steps=0) is True
    assert c.overhead(0) == pytest.approx(0.5) and c.overhead(1) == 1.0  # drafting rounds keep the prior


def test_a_round_faster_than_the_curve_is_a_bounded_discount_and_never_free():
    c = PassCostModel(FLAT)
    c.observe_time(0.0, step_rows=2, steps=0)
    assert c.overhead_ms == -MAX_DISCOUNT * FLAT[0]
    c.observe_load(step_rows=8, own_rows=3)  # on the flat curve under load a round adds nothing to its step
    assert c.round_cost(0) == MIN_ROUND_MS


def test_a_replay_is_priced_only_with_recurrent_state_and_where_per_row_states_do_not_serve():
    flat = [10.0 + 0.5 * w for w in range(1, 17)]
    alphas = [0.3, 0.3, 0.3, 0.3]
    plain, replay = PassCostModel(flat), PassCostModel(flat, replay=True)
    per_row = PassCostModel(flat, replay=True, free_fold_rows=8)
    capped = PassCostModel(flat, replay=True, free_fold_rows=2)
    assert plain.replay_cost(alphas) == 0.0 and replay.replay_cost([]) == 0.0 and per_row.replay_cost(alphas) == 0.0
    assert replay.replay_cost(alphas) > 0.0 and replay.round_cost(4, alphas=alphas) > plain.round_cost(4)
    assert capped.replay_cost(alphas[:2]) == 0.0 and 0.0 < capped.replay_cost(alphas) < replay.replay_cost(alphas)
