"""Speculative verification: greedy cases, exactness of sampled verification, filtering, stats."""

import math
from typing import cast

import numpy as np
import pytest

from inferlet.spec.distribution import filter_distribution
from inferlet.spec.stats import SpecStats
from inferlet.spec.verify import VerifyResult, verify_greedy, verify_sampled

TRIALS = 200_000
ALPHA = 1e-4


def chi2_sf_even(x: float, df: int) -> float:
    """Chi-square survival function for even df (closed form: a Poisson tail)."""
    assert df % 2 == 0
    h = x / 2
    return math.exp(-h) * sum(h**j / math.factorial(j) for j in range(df // 2))


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf_even(mid, df) > alpha else (lo, mid)
    return hi


def test_chi2_critical_matches_table():
    # Published table values.
    assert chi2_critical(2, 0.05) == pytest.approx(5.991, abs=1e-3)
    assert chi2_critical(10, 0.01) == pytest.approx(23.209, abs=1e-3)
    assert chi2_critical(4, 1e-3) == pytest.approx(18.467, abs=1e-3)
    assert chi2_critical(24, 1e-3) == pytest.approx(51.179, abs=1e-3)
    assert chi2_critical(4) == pytest.approx(23.513, abs=1e-3)


def assert_matches(counts: np.ndarray, probs: np.ndarray, tv_bound: float = 0.01) -> None:
    """Chi-square goodness of fit at ALPHA plus a total-variation bound."""
    counts = counts.ravel().astype(np.float64)
    probs = probs.ravel()
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "emitted a token the target gives probability 0"
    expected = n * probs[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} >= {chi2_critical(df):.1f} (df {df})"
    tv = 0.5 * np.abs(counts / n - probs).sum()
    assert tv < tv_bound, f"total variation {tv:.4f}"


def fails_check(counts: np.ndarray, probs: np.ndarray) -> bool:
    try:
        assert_matches(counts, probs)
    except AssertionError:
        return True
    return False


P0 = np.array([0.40, 0.25, 0.15, 0.12, 0.08])
Q0 = np.array([0.10, 0.20, 0.40, 0.05, 0.25])


# ---- greedy ----------------------------------------------------------------------------------


def test_greedy_all_accepted_gets_bonus():
    assert verify_greedy([3, 4, 5], [3, 4, 5, 6]) == VerifyResult([3, 4, 5, 6], 3, 3)


def test_greedy_first_rejected():
    assert verify_greedy([3, 4, 5], [7, 4, 5, 6]) == VerifyResult([7], 0, 3)


def test_greedy_middle_rejected():
    assert verify_greedy([3, 4, 5], [3, 9, 5, 6]) == VerifyResult([3, 9], 1, 3)


def test_greedy_no_drafts():
    assert verify_greedy([], [8]) == VerifyResult([8], 0, 0)


def test_greedy_window_length_checked():
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])


def test_sampled_with_one_hot_target_is_greedy():
    rng = np.random.default_rng(0)
    target = [2, 0, 4, 1]
    p = np.eye(5)[target]
    for drafts in ([2, 0, 4], [2, 3, 4], [1, 0, 4], []):
        want = verify_greedy(drafts, target[: len(drafts) + 1])
        p_rows = p[: len(drafts) + 1]
        assert verify_sampled(drafts, p_rows, None, rng) == want
        q = np.full((len(drafts), 5), 0.2)
        assert verify_sampled(drafts, p_rows, q, rng) == want


# ---- sampled: edge cases ---------------------------------------------------------------------


def test_sampled_no_drafts_samples_p0():
    rng = np.random.default_rng(1)
    counts = np.zeros(5)
    for _ in range(50_000):
        r = verify_sampled([], P0[None], None, rng)
        assert (r.accepted, r.proposed, len(r.tokens)) == (0, 0, 1)
        counts[r.tokens[0]] += 1
    assert_matches(counts, P0)


def test_sampled_draft_with_zero_draft_probability_is_rejected():
    rng = np.random.default_rng(2)
    q = np.array([[0.0, 0.5, 0.5, 0.0, 0.0]])
    for _ in range(200):
        r = verify_sampled([0], np.stack([P0, P0]), q, rng)
        assert r.accepted == 0 and len(r.tokens) == 1


def test_sampled_draft_target_never_emits_is_rejected():
    rng = np.random.default_rng(3)
    p = np.array([[0.0, 0.5, 0.5, 0.0, 0.0], P0])
    for _ in range(200):
        r = verify_sampled([0], p, None, rng)
        assert r.accepted == 0 and r.tokens[0] in (1, 2)


def test_sampled_empty_residual_falls_back_to_p():
    # p == q leaves no residual max(0, p - q); a rejection then can only come from the ratio
    # test at u ~ 1, so drive it with a generator that always returns the top of [0, 1).
    class TopRng:
        def random(self):
            return np.nextafter(1.0, 0.0)

    top = cast(np.random.Generator, TopRng())  # draws u ~ 1 every time
    p = np.stack([P0, P0])
    q = (P0 * (1 - 1e-12))[None]  # p/q a hair above 1: accepted even at u ~ 1
    assert verify_sampled([0], p, q, top).accepted == 1
    q = P0[None]  # p/q == 1 exactly: accepted
    assert verify_sampled([0], p, q, top).accepted == 1
    q = np.array([[0.41, 0.25, 0.15, 0.12, 0.07]])  # p(0)/q(0) < 1: rejected at u ~ 1
    r = verify_sampled([0], p, q, top)
    assert r.accepted == 0 and r.tokens == [4]  # the residual's only mass is on token 4
    one_hot = np.array([[0.0, 0.0, 1.0, 0.0, 0.0], P0])
    # q above p everywhere (only float rounding makes this possible): no residual, fall back to p.
    q = one_hot[:1] * 2
    r = verify_sampled([2], one_hot, q, top)
    assert r.accepted == 0 and r.tokens == [2]


# ---- sampled: the output distribution is the target's ----------------------------------------


def first_token_counts(q: np.ndarray | None, seed: int) -> tuple[np.ndarray, int]:
    rng = np.random.default_rng(seed)
    p = np.stack([P0, P0])
    counts = np.zeros(5)
    accepted = 0
    for _ in range(TRIALS):
        if q is None:
            d = 2  # a lookup drafter that always guesses token 2
            r = verify_sampled([d], p, None, rng)
        else:
            d = int(rng.choice(5, p=q))
            r = verify_sampled([d], p, q[None], rng)
        counts[r.tokens[0]] += 1
        accepted += r.accepted
    return counts, accepted


def test_first_token_is_target_distributed_with_real_q():
    counts, accepted = first_token_counts(Q0, seed=10)
    assert_matches(counts, P0)
    # Acceptance rate of speculative sampling is sum(min(p, q)).
    assert accepted / TRIALS == pytest.approx(np.minimum(P0, Q0).sum(), abs=0.01)


def test_first_token_is_target_distributed_with_point_mass_q():
    counts, accepted = first_token_counts(None, seed=11)
    assert_matches(counts, P0)
    assert accepted / TRIALS == pytest.approx(P0[2], abs=0.01)


def test_check_rejects_naive_resampling():
    # Resampling from p (not the residual) after a rejection biases toward q's favourites; the
    # same check, at the same number of trials, must catch it.
    beta = np.minimum(P0, Q0).sum()
    biased = np.minimum(P0, Q0) + (1 - beta) * P0
    samples = np.random.default_rng(12).choice(5, size=TRIALS, p=biased)
    assert fails_check(np.bincount(samples, minlength=5), P0)


# A Markov target T[prev] and a different Markov drafter Q[prev], V = 5: every window row of the
# target depends on the token before it, as in a real model.
T = np.array(
    [
        [0.40, 0.25, 0.15, 0.12, 0.08],
        [0.10, 0.10, 0.50, 0.20, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.05, 0.45, 0.10, 0.10, 0.30],
        [0.30, 0.05, 0.05, 0.30, 0.30],
    ]
)
Q = np.array(
    [
        [0.10, 0.20, 0.40, 0.05, 0.25],
        [0.50, 0.10, 0.10, 0.10, 0.20],
        [0.05, 0.05, 0.10, 0.40, 0.40],
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.30, 0.30, 0.10, 0.10, 0.20],
    ]
)


def generate_two(last: int, k: int, point_mass: bool, rng: np.random.Generator) -> tuple[int, int]:
    """Run speculative rounds from `last` until two tokens are emitted."""
    out: list[int] = []
    while len(out) < 2:
        prev = out[-1] if out else last
        drafts: list[int] = []
        for _ in range(k):
            if point_mass:
                drafts.append((prev + 1) % 5)  # deterministic drafter
            else:
                drafts.append(int(rng.choice(5, p=Q[prev])))
            prev = drafts[-1]
        window = [out[-1] if out else last] + drafts
        p = T[window]
        q = None if point_mass else Q[window[:-1]]
        out += verify_sampled(drafts, p, q, rng).tokens
    return out[0], out[1]


@pytest.mark.parametrize("point_mass", [False, True])
def test_two_tokens_are_target_distributed(point_mass):
    # The joint law of the first two emitted tokens is T[last][a] * T[a][b]; this holds the
    # second token given the first (within a round and across the round boundary) to the target.
    rng = np.random.default_rng(20 + point_mass)
    last = 0
    counts = np.zeros((5, 5))
    for _ in range(TRIALS // 2):
        a, b = generate_two(last, k=2, point_mass=point_mass, rng=rng)
        counts[a, b] += 1
    joint = T[last][:, None] * T
    assert_matches(counts, joint, tv_bound=0.02)


# ---- filter_distribution ---------------------------------------------------------------------


LOGITS = np.array([1.0, 3.0, 2.0, 3.0, -1.0])


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_filter_plain_temperature():
    np.testing.assert_allclose(filter_distribution(LOGITS, 0.5), softmax(LOGITS / 0.5))
    np.testing.assert_allclose(filter_distribution(LOGITS, 1.0), softmax(LOGITS))


def test_filter_temperature_zero_is_one_hot_lowest_index():
    np.testing.assert_array_equal(filter_distribution(LOGITS, 0.0), [0, 1, 0, 0, 0])


def test_filter_temperature_zero_respects_mask():
    mask = np.array([True, False, True, False, True])
    np.testing.assert_array_equal(filter_distribution(LOGITS, 0.0, mask=mask), [0, 0, 1, 0, 0])


def test_filter_top_k():
    got = filter_distribution(LOGITS, 1.0, top_k=3)
    np.testing.assert_allclose(got, softmax(np.array([-np.inf, 3.0, 2.0, 3.0, -np.inf])))
    # Ties at the k-th logit are all kept.
    tie = filter_distribution(LOGITS, 1.0, top_k=1)
    np.testing.assert_allclose(tie, [0, 0.5, 0, 0.5, 0])


def test_filter_top_p_keeps_smallest_prefix_reaching_mass():
    logits = np.log(np.array([0.1, 0.5, 0.3, 0.05, 0.05]))
    np.testing.assert_allclose(filter_distribution(logits, 1.0, top_p=0.5), [0, 1, 0, 0, 0])
    np.testing.assert_allclose(filter_distribution(logits, 1.0, top_p=0.6), [0, 0.5 / 0.8, 0.3 / 0.8, 0, 0])
    np.testing.assert_allclose(filter_distribution(logits, 1.0, top_p=0.85), [0.1 / 0.9, 0.5 / 0.9, 0.3 / 0.9, 0, 0])


def test_filter_top_p_applies_to_the_top_k_renormalized_mass():
    logits = np.log(np.array([0.1, 0.5, 0.3, 0.05, 0.05]))
    # After top-2 the masses are 0.625 and 0.375, so 0.6 is reached by the first token alone.
    got = filter_distribution(logits, 1.0, top_k=2, top_p=0.6)
    np.testing.assert_allclose(got, [0, 1, 0, 0, 0])


def test_filter_top_p_always_keeps_one_token():
    np.testing.assert_allclose(filter_distribution(LOGITS, 1.0, top_p=1e-9), [0, 1, 0, 0, 0])


def test_filter_top_p_tie_broken_by_lower_index():
    np.testing.assert_allclose(filter_distribution(np.zeros(4), 1.0, top_p=0.5), [0.5, 0.5, 0, 0])


def test_filter_mask():
    mask = np.array([True, False, True, False, True])
    got = filter_distribution(LOGITS, 1.0, mask=mask)
    np.testing.assert_allclose(got, softmax(np.array([1.0, -np.inf, 2.0, -np.inf, -1.0])))
    # top-k chooses among allowed tokens only.
    top1 = filter_distribution(LOGITS, 1.0, top_k=1, mask=mask)
    np.testing.assert_allclose(top1, [0, 0, 1, 0, 0])


def test_filter_batched_rows_match_single_rows():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(2, 3, 11))
    got = filter_distribution(logits, 0.7, top_k=6, top_p=0.8)
    assert got.shape == logits.shape
    np.testing.assert_allclose(got.sum(-1), 1.0)
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(got[i, j], filter_distribution(logits[i, j], 0.7, 6, 0.8))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": 1.0, "top_p": 0.0},
        {"temperature": 1.0, "top_k": -1},
        {"temperature": 1.0, "mask": np.zeros(5, dtype=bool)},
    ],
)
def test_filter_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        filter_distribution(LOGITS, **kwargs)


@pytest.mark.parametrize("temperature", [1e-300, 1e-9, 9.9e-5])
def test_filter_tiny_temperature_is_greedy(temperature):
    np.testing.assert_array_equal(filter_distribution(LOGITS, temperature), [0, 1, 0, 0, 0])
    np.testing.assert_array_equal(filter_distribution(LOGITS, temperature, top_p=1e-300), [0, 1, 0, 0, 0])


def test_filter_tiny_top_p_keeps_the_top_token():
    np.testing.assert_array_equal(filter_distribution(LOGITS, 1.0, top_p=1e-300), [0, 1, 0, 0, 0])
    np.testing.assert_array_equal(filter_distribution(LOGITS, 1e4, top_p=1e-300, top_k=10**9), [0, 1, 0, 0, 0])


def test_filter_huge_temperature_is_near_uniform_and_capped():
    got = filter_distribution(LOGITS, 1e4)
    np.testing.assert_allclose(got, np.full(5, 0.2), atol=1e-3)
    np.testing.assert_array_equal(filter_distribution(LOGITS, 1e300), got)  # counts as MAX_TEMPERATURE


@pytest.mark.parametrize("temperature", [0.0, 1e-300, 1e-4, 0.5, 1.0, 1e4, 1e300])
@pytest.mark.parametrize("top_p", [1e-300, 0.5, 1.0])
@pytest.mark.parametrize("top_k", [0, 1, 3, 10**9])
def test_filter_is_finite_for_any_logits(temperature, top_p, top_k):
    inf, nan = np.inf, np.nan
    logits = np.array(
        [
            [1.0, 3, 2, 3, -1],
            [nan] * 5,
            [inf, 1, inf, 2, 3],
            [-inf] * 5,
            [1e308, -1e308, 0, 1, 2],
            [nan, 1, -inf, inf, 0],
        ]
    )
    with np.errstate(invalid="raise", divide="raise"):  # no inf - inf, 0 / 0 or x / 0 on the way
        got = filter_distribution(logits, temperature, top_k, top_p)
    assert np.isfinite(got).all() and (got >= 0).all()
    np.testing.assert_allclose(got.sum(-1), 1.0)
    assert got[1].argmax() == 0 and got[3].argmax() == 0  # nothing finite: the first token leads
    assert got[2][[1, 3, 4]].sum() == 0 and got[5][3] == 1.0  # +inf logits take the whole row


def test_filter_nan_logits_never_win():
    logits = np.array([np.nan, 1.0, np.nan, 0.0])
    np.testing.assert_array_equal(filter_distribution(logits, 0.0), [0, 1, 0, 0])
    assert filter_distribution(logits, 1.0)[[0, 2]].sum() == 0
    # a mask whose allowed tokens are all NaN or -inf leaves them uniform
    mask = np.array([True, False, True, False])
    np.testing.assert_allclose(filter_distribution(logits, 1.0, mask=mask), [0.5, 0, 0.5, 0])


@pytest.mark.parametrize("kwargs", [{"temperature": np.nan}, {"temperature": 1.0, "top_p": np.nan}])
def test_filter_rejects_nan_arguments(kwargs):
    with pytest.raises(ValueError):
        filter_distribution(LOGITS, **kwargs)


# ---- stats -----------------------------------------------------------------------------------


def test_stats():
    stats = SpecStats()
    stats.record(VerifyResult([1, 2, 3, 4], accepted=3, proposed=3))
    stats.record(VerifyResult([1, 9], accepted=1, proposed=3))
    stats.record(VerifyResult([7], accepted=0, proposed=2))
    stats.skip("penalties")
    stats.skip("penalties")
    stats.skip("no_draft")
    d = stats.as_dict(decode_tokens_per_s=123.0, prefill_ms=4.5)
    assert d == {
        "rounds": 3,
        "proposed": 8,
        "accepted": 4,
        "acceptance": 0.5,
        "acceptance_per_position": [2 / 3, 1 / 3, 1 / 2],
        "acceptance_given_kept": [2 / 3, 1 / 2, 1.0],  # reached by 3, 2 and 1 of the rounds
        "rejecting_round_share": 2 / 3,
        "replayed_rows": 0,
        "skipped": {"penalties": 2, "no_draft": 1},
        "rows_per_round": 1 + 8 / 3,
        "accepted_depth": 4 / 3,
        "tree_rounds": 0,
        "tree_rows": 0.0,
        "tree_depth": 0.0,
        "decode_tokens_per_s": 123.0,
        "prefill_ms": 4.5,
    }


def test_stats_empty():
    d = SpecStats().as_dict(0.0, 0.0)
    assert d["acceptance"] == 0.0 and d["rejecting_round_share"] == 0.0
    assert d["acceptance_per_position"] == [] and d["skipped"] == {}


def test_a_greedy_filter_builds_one_hot_rows_not_an_identity():
    """Below MIN_TEMPERATURE the rows are one-hot at the argmax; building them must not allocate a V x V identity
    (49,152^2 float64 is 19 GB: a schema fuzzer's temperature of 6e-8 once stalled a serving host for seconds)."""
    import tracemalloc

    x = np.random.default_rng(0).normal(size=(2, 49152))
    tracemalloc.start()
    try:
        p = filter_distribution(x, 6e-8, top_k=25526, top_p=1e-120)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * x.nbytes
    assert np.array_equal(p.argmax(-1), x.argmax(-1)) and np.array_equal(p.sum(-1), [1.0, 1.0])
    assert np.count_nonzero(p) == 2
