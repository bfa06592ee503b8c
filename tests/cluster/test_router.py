"""The router's policy without Ray: rendezvous hashing, the approximate prefix tree, cache-aware placement,
the imbalance guard and refusals."""

from __future__ import annotations

import random

import pytest

from pie_runtime.cluster.prefix_tree import PrefixTree
from pie_runtime.cluster.rendezvous import rendezvous_order
from pie_runtime.cluster.router import NoEngine, Router, RouterConfig


def router(n: int, **config) -> Router:
    r = Router(RouterConfig(**config))
    for i in range(n):
        r.add(f"e{i}")
    return r


def prompt(system: int, user: int, sys_len: int = 64, user_len: int = 16) -> list[int]:
    rng = random.Random(system)
    head = [rng.randrange(1000) for _ in range(sys_len)]
    rng = random.Random(10_000 + user)
    return head + [rng.randrange(1000) for _ in range(user_len)]


# --- rendezvous ---


def test_rendezvous_is_stable_and_moves_only_the_removed_engines_keys():
    engines = [f"e{i}" for i in range(5)]
    keys = [f"session-{i}" for i in range(500)]
    before = {k: rendezvous_order(k, engines)[0] for k in keys}
    assert before == {k: rendezvous_order(k, list(reversed(engines)))[0] for k in keys}  # order-free
    assert len(set(before.values())) == 5
    after = {k: rendezvous_order(k, [e for e in engines if e != "e2"])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "e2"}
    for k in moved:  # a moved key goes to its second choice
        assert after[k] == rendezvous_order(k, engines)[1]


# --- prefix tree ---


def test_tree_matches_whole_blocks_per_engine():
    t = PrefixTree(block=4)
    t.insert(list(range(10)), "a")  # blocks [0..3], [4..7]; the last 2 tokens are no whole block
    t.insert([0, 1, 2, 3, 9, 9, 9, 9], "b")
    assert t.match(list(range(12))) == {"a": 8, "b": 4}
    assert t.match([0, 1, 2, 3, 9, 9, 9, 9, 5]) == {"a": 4, "b": 8}
    assert t.match([1, 2, 3, 4]) == {}
    assert t.match([0, 1, 2]) == {}
    assert (t.size("a"), t.size("b")) == (2, 2)


def test_tree_evicts_least_recently_used_leaves_first():
    t = PrefixTree(block=2, max_blocks=4)
    t.insert([1, 1, 2, 2], "a")  # old branch
    t.insert([1, 1, 3, 3], "a")
    t.insert([1, 1, 3, 3], "a")  # touched again: newer than [2, 2]
    assert t.size("a") == 3
    t.insert([5, 5, 6, 6], "a")  # 5 blocks: the oldest leaf goes
    assert t.size("a") == 4
    assert t.match([1, 1, 2, 2]) == {"a": 2}
    assert t.match([1, 1, 3, 3]) == {"a": 4}
    assert t.match([5, 5, 6, 6]) == {"a": 4}


def test_tree_eviction_of_one_engine_leaves_others_and_remove_forgets():
    t = PrefixTree(block=2, max_blocks=2)
    t.insert([1, 1, 2, 2], "b")
    t.insert([1, 1, 2, 2, 3, 3], "a")  # a holds 3 blocks > 2: its leaf [3, 3] goes
    assert t.match([1, 1, 2, 2, 3, 3]) == {"a": 4, "b": 4}
    t.remove("a")
    assert t.match([1, 1, 2, 2, 3, 3]) == {"b": 4}
    assert t.size("a") == 0
    t.remove("b")
    assert t.match([1, 1, 2, 2]) == {}


# --- placement ---


def test_shared_prefix_sticks_to_one_engine_and_new_prefixes_spread():
    r = router(3)
    first = {s: r.place(prompt(s, 0)).engine for s in range(3)}
    assert sorted(first.values()) == ["e0", "e1", "e2"]  # each new system prompt to the least cached engine
    for s in range(3):
        for u in range(1, 6):
            p = r.place(prompt(s, u))
            assert (p.engine, p.reason, p.matched_tokens) == (first[s], "cache", 64)


def test_a_match_under_the_threshold_goes_to_the_least_cached_engine():
    r = router(2, cache_threshold=0.5)
    a = r.place(prompt(1, 0, sys_len=16, user_len=48))  # 16 of 64 tokens shared: 25%
    b = r.place(prompt(1, 1, sys_len=16, user_len=48))
    assert b.reason == "least_cached" and b.engine != a.engine


def test_session_key_is_a_soft_rendezvous_preference():
    r = router(4)
    for key in ("alice", "bob", "carol"):
        want = rendezvous_order(key, r.live())
        places = [r.place(prompt(i, i), session=key) for i in range(5)]
        assert {(p.engine, p.reason) for p in places} == {(want[0], "session")}
        r.report(want[0], free_pages=0)  # the preferred engine is full: the next one in the key's order
        assert r.place(prompt(9, 9), session=key, pages=1).engine == want[1]
        r.report(want[0], free_pages=None)


def test_imbalance_guard_needs_both_thresholds():
    r = router(2, balance_abs=4, balance_rel=1.5)
    for _ in range(5):
        assert r.place(prompt(1, 0)).engine == "e0"  # affinity piles runs on e0 ...
    r2 = r.place(prompt(1, 0))  # ... until 5 - 0 > 4 and 5 > 1.5 x 0: the guard sends it to e1
    assert (r2.engine, r2.reason) == ("e1", "balance")
    r3 = r.place(prompt(1, 0))  # both hold the prefix now: the less loaded one
    assert (r3.engine, r3.reason) == ("e1", "cache")
    # the absolute gap alone is not enough: 100 vs 80 is within 1.5x
    r3 = router(2, balance_abs=4, balance_rel=1.5)
    r3.engines["e0"].in_flight, r3.engines["e1"].in_flight = 100, 80
    assert not r3.imbalanced(["e0", "e1"])
    r3.engines["e1"].in_flight = 60
    assert r3.imbalanced(["e0", "e1"])


def test_default_guard_is_sglangs_64_and_1_5():
    r = router(2)
    r.engines["e0"].in_flight = 64
    assert not r.imbalanced(["e0", "e1"])  # 64 - 0 is not over 64
    r.engines["e0"].in_flight = 65
    assert r.imbalanced(["e0", "e1"])


def test_refusal_tries_the_next_candidate_and_all_refusing_raises():
    r = router(2)
    home = r.place(prompt(3, 0)).engine
    other = "e1" if home == "e0" else "e0"
    r.report(home, free_pages=3)
    p = r.place(prompt(3, 1), pages=4)
    assert p.engine == other and p.candidates[0] == home and p.matched_tokens == 0
    r.report(other, free_pages=4)
    assert r.place(prompt(5, 0), pages=4).engine == other
    assert r.engines[other].free_pages == 0  # debited until its next report
    with pytest.raises(NoEngine):
        r.place(prompt(6, 0), pages=4)


def test_lost_engine_gets_nothing_and_rejoins_empty():
    r = router(2)
    home = r.place(prompt(4, 0)).engine
    r.lose(home)
    for u in range(5):
        assert r.place(prompt(4, u + 1)).engine != home
    assert r.engines[home].in_flight == 0
    r.add(home)  # restarted: it rejoins with an empty cache, so it is the least cached engine
    assert r.place(prompt(7, 0)).engine == home
    with pytest.raises(NoEngine):
        r.place(prompt(1, 1), exclude=["e0", "e1"])


def test_done_lowers_in_flight():
    r = router(2, balance_abs=1, balance_rel=1.0)
    places = [r.place(prompt(1, u)) for u in range(4)]
    assert sorted(r.engines[e].in_flight for e in r.live()) == [2, 2]  # the guard spread them
    for p in places:
        r.done(p.engine)
    assert all(r.engines[e].in_flight == 0 for e in r.live())


def test_round_robin_takes_engines_in_turn_whatever_the_prefix():
    r = router(3, policy="round_robin")
    engines = [r.place(prompt(1, u)).engine for u in range(6)]
    assert engines[:3] == engines[3:] and sorted(engines[:3]) == ["e0", "e1", "e2"]
