"""The acceptance estimate alone: per-position acceptance learnt from verdicts, conditioned on how the last
round ended, with a training record as prior; the tokens a round is expected to emit; a token tree's per-depth
acceptance; the verdicts a round may end in."""

from __future__ import annotations

import copy

import pytest

from inferlet.spec.acceptance import AcceptanceEstimate

HEAD = (0.62, 0.54)  # an MTP head's training record: held-out acceptance of draft 1, and of 2 given 1


def test_expected_tokens_is_the_geometric_sum_under_uniform_acceptance():
    e = AcceptanceEstimate(8, decay=1.0, prior_alpha=0.0)
    e.hits, e.trials = 0.6, 1.0  # pooled α = 0.6, no per-position evidence
    a = 0.6
    for k in range(9):
        assert e.expected_tokens(k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))


def test_per_position_acceptance_follows_the_drafter():
    """An MTP-like drafter: first drafts kept often, second drafts almost never."""
    e = AcceptanceEstimate(3)
    for i in range(20):
        e.observe(2, 1 if i % 4 else 0)
    assert e.position_alpha(0) > 0.6 and e.position_alpha(1) < 0.2
    assert e.alphas(2) == [e.position_alpha(0), e.position_alpha(1)]


def test_acceptance_is_conditioned_on_how_the_last_round_ended():
    """A lookup's hits come in runs: after a full round α is high, after a rejection low."""
    e = AcceptanceEstimate(4)
    for _ in range(10):
        for _ in range(3):
            e.observe(4, 4)
        for _ in range(3):
            e.observe(4, 0)
    after_miss = e.position_alpha(0)
    e.observe(4, 4)
    assert e.full and e.position_alpha(0) > after_miss + 0.3


def test_no_draft_rounds_teach_nothing():
    e = AcceptanceEstimate(8)
    before = copy.deepcopy(vars(e))
    e.observe(0, 0)
    assert vars(e) == before


def test_the_slow_estimate_forgets_a_miss_slower_than_the_pooled_one():
    e = AcceptanceEstimate(4)
    for _ in range(20):
        e.observe(2, 2)
    e.observe(2, 0)
    e.observe(2, 0)
    assert e.slow_alpha > e.alpha


def test_tree_rounds_learn_per_depth_acceptance():
    e = AcceptanceEstimate(4, decay=1.0)
    for _ in range(30):
        e.observe_tree(3, 2)  # always keeps two levels, never the third
    assert e.tree_alpha(0, 2) > 0.9 and e.tree_alpha(1, 2) > 0.9 and e.tree_alpha(2, 2) < 0.1
    assert e.tree_expected_tokens([2, 2, 2]) == pytest.approx(
        1 + e.tree_alpha(0, 2) * (1 + e.tree_alpha(1, 2)), abs=0.05
    )


def test_a_tree_candidate_prior_counts_every_candidate_at_a_depth():
    e = AcceptanceEstimate(4, prior_alpha=0.3)
    assert e.tree_alpha(0, 4) == pytest.approx(1 - (1 - e.position_alpha(0)) ** 4)
    assert e.tree_alpha(0, 4) > e.tree_alpha(0, 1)


def test_a_recorded_acceptance_fills_the_positions_it_does_not_reach():
    assert AcceptanceEstimate(4, prior=HEAD).prior == [0.62, 0.54, 0.54, 0.54]
    assert AcceptanceEstimate(4, prior=()).prior == []


def test_the_verdicts_of_a_round_are_a_distribution_over_what_it_keeps():
    e = AcceptanceEstimate(3, prior=HEAD)
    outcomes = e.verdicts(3)
    assert len(outcomes) == 4 and sum(p for p, _ in outcomes) == pytest.approx(1.0)
    kept_all = outcomes[-1][1]
    assert kept_all.full and not outcomes[0][1].full
    assert not e.full and e.pos_trials == [0.0] * 3  # each verdict observed on a copy, not on the estimate
