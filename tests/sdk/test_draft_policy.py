"""The drafting policy over its two parts (tests/sdk/test_acceptance.py, test_pass_cost.py): picks the count with the
most expected tokens per ms for the cost curve it is given, follows acceptance up and down, probes, times plain
rounds, chooses a tree or a chain and a head's chain depth, and falls back to the fixed length without a curve."""

from __future__ import annotations

import copy
import random

from inferlet.readouts import Logits
from inferlet.spec.chained import ChainedDrafter
from inferlet.spec.draft_policy import FIRST_TIMING, TIMING_EVERY, DraftPolicy

FLAT = [40.0] * 32  # every window costs one pass (a GPU, or bf16 with AMX)
# The shape measured on the 2-core CPU in float32: up to 3 rows cost about one, then a step, then a slope.
CPU = [36.0, 36.5, 39.0, 49.0, 50.5, 52.5, 54.0, 56.0] + [56.0 + 1.6 * i for i in range(1, 25)]
LINEAR = [40.0 * w for w in range(1, 33)]  # a window of w rows costs w passes: drafting never pays


def feed(p: DraftPolicy, rounds: int, accepted_share: float) -> None:
    for _ in range(rounds):
        k = p.next()
        p.observe(k, round(k * accepted_share))


def test_without_costs_every_round_drafts_the_maximum():
    p = DraftPolicy(8, [])
    assert not p.adaptive
    feed(p, 5, 0.0)
    assert p.next() == 8


def test_hits_grow_the_window_to_the_maximum_on_a_flat_curve():
    p = DraftPolicy(16, FLAT)
    feed(p, 6, 1.0)
    assert p.next() == 16


def test_misses_shrink_the_window_on_the_cpu_curve_and_hits_grow_it_back():
    p = DraftPolicy(16, CPU)
    feed(p, 6, 1.0)
    assert p.next() == 16
    feed(p, 4, 0.0)
    low = p.next()
    assert 1 <= low <= 2  # a probe the cheap rows pay for
    feed(p, 6, 1.0)
    assert p.next() == 16


def test_a_drafter_that_does_not_pay_gets_plain_steps_and_periodic_probes():
    p = DraftPolicy(8, LINEAR, probe_every=4)
    ks = []
    for _ in range(12):
        k = p.next()
        ks.append(k)
        p.observe(k, 0)
    assert ks == [0, 0, 0, 1] * 3  # a window costs as much as its rows in plain steps: only probes draft
    assert DraftPolicy(0, CPU).next() == 0  # an inferlet that asked for none


def test_a_probe_that_hits_brings_drafting_back():
    p = DraftPolicy(8, CPU, draft_cost_ms=12.0, probe_every=2)
    for _ in range(6):
        p.observe(max(p.next(), 1), 0)
    assert p.best() == 0
    for _ in range(4):
        p.observe(1, 1)
    assert p.next() >= 1


def test_draft_cost_makes_longer_drafts_pay_less():
    free, costly = DraftPolicy(8, FLAT), DraftPolicy(8, FLAT, draft_cost_ms=30.0)
    for p in (free, costly):
        for _ in range(8):
            p.observe(4, 2)  # accepts about two thirds of the drafts it is shown
    assert costly.next() < free.next()


def test_will_draft_predicts_next_without_counting_as_a_round():
    p = DraftPolicy(4, LINEAR, probe_every=3)
    for _ in range(9):
        predicted, idle = p.will_draft(), p.idle
        assert p.will_draft() == predicted and p.idle == idle  # asking twice changes nothing
        assert (p.next() > 0) == predicted
    assert DraftPolicy(4, []).will_draft() and not DraftPolicy(0, CPU).will_draft()


def test_most_next_bounds_what_any_verdict_of_the_round_leads_to():
    """A head drafter computes next round's drafts in this round's fire, before the verdict: most_next is the
    most that next() can then ask for, and no less than what a round of hits leads to."""
    rng = random.Random(0)
    for curve in (CPU, INT4, FLAT, LINEAR):
        p = DraftPolicy(4, curve, probe_every=3)
        for _ in range(60):
            k = p.next()
            bound = p.most_next(k)
            outcomes = []
            for accepted in range(k + 1):
                after = copy.deepcopy(p)
                after.observe(k, accepted)
                outcomes.append(after.next())
            assert bound == max(outcomes)
            p.observe(k, min(k, int(rng.random() * (k + 1))))


def test_after_a_round_of_one_that_may_hit_the_head_chains_more_than_one():
    p = DraftPolicy(3, INT4)
    p.observe(p.next(), 0)  # a miss: the planner probes with one
    k = p.next()
    assert k == 1
    hit = copy.deepcopy(p)
    hit.observe(k, k)
    assert hit.next() > k and p.most_next(k) == hit.next()
    loser = DraftPolicy(4, LINEAR, probe_every=8)
    assert loser.next() == 0 and loser.most_next(0) == 0  # nothing to chain before a plain round


# int4 on the same CPU (pie bench decode): flat to 2 rows, then about 1 ms a row
INT4 = [12.4, 12.4, 12.9, 13.3, 14.5, 15.7, 16.8, 18.0] + [18.0 + 1.1 * i for i in range(1, 25)]


def test_a_loaded_engine_gets_shorter_drafts_or_none():
    """The same acceptance drafts long in an empty step and less in one that other sequences fill: each extra
    row then costs its full share of the step instead of riding on a pass that runs anyway."""
    p = DraftPolicy(16, INT4)
    feed(p, 6, 0.5)
    alone = p.best()
    p.observe_load(step_rows=25, own_rows=1)
    assert p.cost.load == 24
    busy = p.best()
    assert busy < alone
    p.observe_load(step_rows=1 + alone, own_rows=1 + alone)  # alone again
    assert p.cost.load == 0 and p.best() == alone


def test_a_full_step_stops_a_weak_drafter():
    p = DraftPolicy(8, INT4)
    feed(p, 8, 0.25)
    assert p.drafting_pays()
    p.observe_load(step_rows=32, own_rows=1)
    assert not p.drafting_pays()


def test_a_replay_makes_rejecting_rounds_dearer_and_windows_shorter():
    flat = [10.0 + 0.5 * w for w in range(1, 17)]  # a CPU-like curve: wider windows nearly free
    plain, replay = DraftPolicy(8, flat), DraftPolicy(8, flat, replay=True)
    for p in (plain, replay):
        for _ in range(6):
            p.observe(4, 1)  # drafts miss often
    assert (
        plain.cost.replay_cost(plain.estimate.alphas(4)) == 0.0
        and replay.cost.replay_cost(replay.estimate.alphas(0)) == 0.0
    )
    assert replay.cost.replay_cost(replay.estimate.alphas(4)) > 0.0 and replay.round_cost(4) > plain.round_cost(4)
    assert replay.best() <= plain.best()


def test_per_row_states_price_no_replay_for_the_folds_they_serve():
    flat = [10.0 + 0.5 * w for w in range(1, 17)]
    plain = DraftPolicy(8, flat)
    per_row = DraftPolicy(8, flat, replay=True, free_fold_rows=8)  # a fold of k + 1 rows needs no state
    capped = DraftPolicy(8, flat, replay=True, free_fold_rows=2)  # folds of 3+ rows still replay
    replay = DraftPolicy(8, flat, replay=True)
    for p in (plain, per_row, capped, replay):
        for _ in range(6):
            p.observe(4, 1)
    assert per_row.cost.replay_cost(per_row.estimate.alphas(8)) == 0.0 and per_row.round_cost(4) == plain.round_cost(4)
    assert per_row.best() == plain.best()
    assert (
        capped.cost.replay_cost(capped.estimate.alphas(2)) == 0.0
        and capped.cost.replay_cost(capped.estimate.alphas(4)) > 0.0
    )
    assert capped.cost.replay_cost(capped.estimate.alphas(4)) < replay.cost.replay_cost(replay.estimate.alphas(4))


# ---- chain or tree ---------------------------------------------------------------------------


def test_a_tree_wins_where_wide_windows_are_free_and_the_first_draft_often_misses():
    p = DraftPolicy(8, FLAT, prior_alpha=0.3)
    assert p.use_tree([4, 1, 1, 1], rows=16)  # prior: one of 4 candidates right beats a single guess
    for _ in range(20):  # tree rounds that keep nothing teach it otherwise
        p.observe_tree(4, 0)
    assert not p.use_tree([4, 1, 1, 1], rows=16)


def test_a_chain_wins_where_rows_cost_their_share():
    p = DraftPolicy(8, LINEAR)
    assert not p.use_tree([3, 2, 1], rows=15)


def test_without_costs_a_tree_drafter_always_drafts_its_tree():
    assert DraftPolicy(4, []).use_tree([2, 2], rows=6)


def test_with_recurrent_state_rounds_are_chains():  # the engine refuses tree fires on such a model
    assert not DraftPolicy(4, [], replay=True).use_tree([2, 2], rows=6)
    assert not DraftPolicy(8, FLAT, prior_alpha=0.3, replay=True).use_tree([4, 1, 1, 1], rows=16)


# int4 on the 2-core Xeon with AMX (the engine's start-up measurement): 4 rows cost little more than 1, 5 a step more
AMX_INT4 = [20.7, 22.6, 23.1, 24.8, 32.5, 32.5, 33.7, 34.8]
MTP_STEP_MS = 0.74


def iid_verdict(k: int, alphas: list[float], rng: random.Random) -> int:
    """Drafts kept of k when the i-th is kept with probability alphas[i] given the ones before it were,
    independently of earlier rounds (an MTP head)."""
    accepted = 0
    while accepted < k and rng.random() < alphas[accepted]:
        accepted += 1
    return accepted


def iid_rounds(p: DraftPolicy, rounds: int, alphas: list[float], rng: random.Random) -> list[int]:
    """``rounds`` rounds of such a drafter; returns the draft counts the planner chose."""
    ks = []
    for _ in range(rounds):
        k = p.next()
        p.observe(k, iid_verdict(k, alphas, rng))
        if not p.timing:  # a timed plain round (one in TIMING_EVERY) is not the planner's choice of k
            ks.append(k)
    return ks


def test_a_measured_overhead_prices_draft_rows_at_their_share_of_the_round():
    """An MTP head's verdicts in rounds whose real overhead is 8 ms: timed, the planner drafts more a round and
    emits more tokens per ms than priced at the 1 ms prior, which made each draft row look three times dearer."""
    rates, mean_k = [], []
    for timed in (False, True):
        tokens = ms = 0.0
        ks = []
        for seed in range(5):  # runs of 400 rounds: the gain is a few percent, one run's luck is about as much
            rng = random.Random(seed)
            p = DraftPolicy(3, AMX_INT4, MTP_STEP_MS)
            for _ in range(400):
                k = p.next()
                accepted = iid_verdict(k, [0.45, 0.55, 0.5], rng)
                p.observe(k, accepted)
                elapsed = AMX_INT4[k] + k * MTP_STEP_MS + 8.0
                if timed:
                    p.observe_time(elapsed, step_rows=1 + k, steps=k)
                tokens, ms = tokens + 1 + accepted, ms + elapsed
                ks.append(k)
        rates.append(tokens / ms)
        mean_k.append(sum(ks) / len(ks))
    assert mean_k[1] > mean_k[0] and rates[1] > rates[0]


def test_an_independent_drafter_keeps_its_window_after_a_miss():
    """Verdicts independent from round to round: conditioned on the last round and forgotten slowly, the
    estimates settle and k holds at what pays on average; forgotten within two rounds, one miss halves α and
    the next round drafts one or none."""
    rng = random.Random(1)
    steady = DraftPolicy(3, AMX_INT4, MTP_STEP_MS)
    steady.cost.overhead_ms = 8.0
    ks = iid_rounds(steady, 300, [0.45, 0.55, 0.5], rng)[100:]
    assert min(ks) >= 2
    swinging = DraftPolicy(3, AMX_INT4, MTP_STEP_MS, state_decay=0.5)
    swinging.cost.overhead_ms = 8.0
    assert min(iid_rounds(swinging, 300, [0.45, 0.55, 0.5], rng)[100:]) <= 1


def test_a_drafter_whose_hits_come_in_runs_drafts_long_after_a_full_round_and_short_after_a_miss():
    """A prompt lookup: inside a copied passage every draft is kept, outside nearly none. Conditioned on how the
    last round ended, the planner drafts the maximum after a full round and little after a rejection."""
    p = DraftPolicy(8, CPU)
    for _ in range(10):  # runs of copies and of free text, alternating
        for _ in range(4):
            k = p.next()
            p.observe(k, k)
        for _ in range(4):
            k = p.next()
            p.observe(k, 0)
    after_miss = p.next()
    k = p.next()
    p.observe(k, k)
    after_full = p.next()
    assert after_miss <= 2 and after_full == 8


HEAD = (0.62, 0.54)  # an MTP head's training record: held-out acceptance of draft 1, and of 2 given 1


def rounds(p: DraftPolicy, n: int, kept: int) -> list[int]:
    """n rounds that keep at most ``kept`` drafts each; the counts the planner chose."""
    ks = []
    for _ in range(n):
        ks.append(k := p.next())
        p.observe(k, min(k, kept))
    return ks


def test_a_recorded_acceptance_keeps_the_second_draft_through_early_misses():
    # two misses at the second position: alone they make it look like a loss; against the head's record
    # they are two rounds of evidence, and the second draft stays
    assert rounds(DraftPolicy(2, AMX_INT4, MTP_STEP_MS), 3, kept=1) == [2, 2, 1]
    assert rounds(DraftPolicy(2, AMX_INT4, MTP_STEP_MS, prior=HEAD), 3, kept=1) == [2, 2, 2]


def test_a_recorded_acceptance_yields_to_a_drafter_that_misses():
    p = DraftPolicy(2, AMX_INT4, MTP_STEP_MS, prior=HEAD)
    assert rounds(p, 4, kept=0)[0] == 2
    assert rounds(p, 16, kept=0).count(0) >= 12  # plain steps but for the probes, as without a record
    assert p.estimate.position_alpha(0) < HEAD[0] / 2


def test_a_round_that_adds_nothing_to_a_loaded_step_is_still_priced():
    """Under load on a flat stretch of the curve, a lookup (no draft cost) whose rounds left no overhead adds
    nothing to its step: the planner drafts the most it may instead of dividing by that nothing (CI once
    failed there, two cacheback runs sharing the engine)."""
    p = DraftPolicy(4, FLAT)
    p.observe_time(0.0, step_rows=2, steps=0)  # a round faster than the curve's pass: the curve overstates it
    assert p.cost.overhead_ms == -0.5 * FLAT[0]  # by at most half a 1-row pass
    p.observe_load(step_rows=8, own_rows=3)
    assert p.round_cost(0) > 0 and p.drafting_pays()
    assert p.next() == 4
    assert p.use_tree([2, 2], rows=4)


# A chained head on the 2-core Xeon in int4 as the engine saw it (docs/performance.md, "The draft-length planner"):
# the curve timed at start says a second row costs 1 ms and the head's step 0.9 ms, where a drafting round really
# costs 2 ms more than a plain one, each further draft row 1.5 ms, and each head step 1.2 ms.
XEON_CURVE = [7.3, 8.26, 8.74, 9.6, 10.26, 11.64]


def xeon_ms(k: int, depth: int) -> float:
    """Wall ms of a round verifying k drafts whose fire chains ``depth`` head steps for the next round."""
    return 6.3 + (2.0 + 1.5 * (k - 1) if k else 0.0) + 1.2 * depth


def head_rounds(p: DraftPolicy, rounds: int, alphas, seed: int, chain) -> tuple[float, float]:
    """A chained head's rounds (drive_rounds' order: next, the fire's chain depth, verdict, timing); ``chain``
    gives the depth a fire chains. Returns tokens per ms over plain decoding's, and the mean depth."""
    rng = random.Random(seed)
    ready = tokens = ms = depths = 0.0
    for _ in range(rounds):
        k = min(p.next(), int(ready))
        depth = chain(p, k)
        accepted = iid_verdict(k, list(alphas), rng)
        p.observe(k, accepted)
        elapsed = xeon_ms(k, depth)
        p.observe_load(1 + k, 1 + k)
        p.observe_time(elapsed, 1 + k, depth)  # the fire paid for the chain it read
        ready, tokens, ms, depths = depth, tokens + 1 + accepted, ms + elapsed, depths + depth
    return tokens / ms * xeon_ms(0, 0), depths / rounds


def by_rate(p: DraftPolicy, k: int) -> int:
    drafter = ChainedDrafter(lambda depth, at: Logits(), p.max_k, p.cost.draft_cost_ms)
    drafter.planner, drafter.proposed = p, k
    return drafter.chain_depth()


def the_most(p: DraftPolicy, k: int) -> int:
    return min(p.max_k, p.most_next(k))


def mean_speedup(alphas, chain, seeds=range(5)) -> tuple[float, float]:
    runs = [head_rounds(DraftPolicy(3, XEON_CURVE, 0.9, prior=alphas), 400, alphas, s, chain) for s in seeds]
    return sum(r[0] for r in runs) / len(runs), sum(r[1] for r in runs) / len(runs)


def test_plain_rounds_are_priced_apart_so_a_head_that_does_not_pay_stops_drafting():
    """Drafting rounds that cost more than the start-up curve says: timed apart from plain ones, the planner
    sees one draft at 0.45 lose (1.45 tokens in 9.5 ms against 1 in 6.3) and decodes at nearly plain speed."""
    speedup, depth = mean_speedup((0.45, 0.4, 0.4), by_rate)
    assert speedup > 0.96 and depth < 0.4


def test_two_drafts_that_pay_are_drafted_where_one_alone_would_not():
    """At 0.8 / 0.7 / 0.7 one draft does not pay here (1.8 tokens in 11.1 ms against plain's 1 in 6.3 is 1.02x
    after the head's step) but two and three do: the planner drafts them, above plain speed."""
    speedup, depth = mean_speedup((0.8, 0.7, 0.7), by_rate)
    assert speedup > 1.1 and depth > 1.5


def test_a_head_chains_what_the_verdicts_pay_for_not_the_most_any_could_ask():
    """Every step of a head's chain is paid before the verdict: weighed over the verdicts, the chain is shorter
    than the most any verdict could ask for, and the head decodes faster for it."""
    rate, rate_depth = mean_speedup((0.8, 0.7, 0.7), by_rate)
    most, most_depth = mean_speedup((0.8, 0.7, 0.7), the_most)
    assert rate_depth < most_depth and rate > most
    p = DraftPolicy(3, XEON_CURVE, 0.9, prior=(0.8, 0.7, 0.7))
    for k in range(4):
        assert p.chain_depth(k) <= p.most_next(k)


def test_while_drafting_pays_a_plain_round_is_timed_now_and_then_and_chains_nothing():
    p = DraftPolicy(4, FLAT, prior=(0.9,))
    timed = []
    for i in range(3 * TIMING_EVERY):
        k = p.next()
        if p.timing:
            timed.append(i)
            assert k == 0 and p.chain_depth(0) == 0
        p.observe(k, k)
    assert timed[0] == FIRST_TIMING and all(b - a == TIMING_EVERY + 1 for a, b in zip(timed, timed[1:]))


def test_a_chained_drafter_reads_the_policy_and_reports_its_steps_without_writing_into_it():
    """The fire's head depth is the policy's choice; the steps it paid reach the policy through the loop
    (``draft_steps``), not by the drafter writing into the policy."""
    from inferlet.spec.drafter import Proposal
    from inferlet.spec.verifier import Verifier
    from inferlet.text import CompletionArgs

    p = DraftPolicy(3, XEON_CURVE, 0.9, prior=(0.8, 0.7, 0.7))
    drafter = ChainedDrafter(lambda depth, at: Logits(), 3, 0.9)
    drafter.planner, drafter.proposed = p, 2
    before = copy.deepcopy(vars(p.estimate)), copy.deepcopy(vars(p.cost)), (p.idle, p.since_plain, p.timing)
    drafter.readouts(Verifier(CompletionArgs(prompt="x")))
    assert (vars(p.estimate), vars(p.cost), (p.idle, p.since_plain, p.timing)) == before
    depth = p.chain_depth(2)
    assert drafter.draft_steps(Proposal([1, 2])) == depth  # the chain it read, once
    assert drafter.draft_steps(Proposal([1, 2])) == 2  # no readouts since: one step a draft
