"""Token trees (inferlet.spec.token_tree): building from candidates, flattening into a tree window, greedy verification,
and sampled verification whose emitted tokens follow the target's distribution exactly — with point-mass
children and with children drawn from a drafter without replacement (recursive rejection sampling)."""

from __future__ import annotations

import numpy as np
import pytest

from inferlet.spec.stats import SpecStats
from inferlet.spec.token_tree import (
    ROOT,
    TokenTree,
    draw_without_replacement,
    parse_shape,
    shape_rows,
    verify_tree_greedy,
    verify_tree_sampled,
)
from pie_runtime.protocol.tree import fold_path, tree_depths
from tests.sdk.test_speculative import Q, T, assert_matches, fails_check

TRIALS = 40_000


def test_shapes_parse_and_count_their_rows():
    assert parse_shape("3,2,1") == [3, 2, 1] and shape_rows([3, 2, 1]) == 3 + 6 + 6
    with pytest.raises(ValueError):
        parse_shape("3,0")


def test_paths_merge_into_a_trie_capped_by_the_widths():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 6, 8], [5, 9], [4, 1], [3, 3]], widths=[2, 2, 1])
    # 5 ─ 6 ─ 7 ; 6 ─ 8 is cut (depth-2 width 1) ; 5 ─ 9 ; 4 ─ 1 ; 3 is cut (root width 2)
    assert tree.tokens == [5, 6, 7, 9, 4, 1]
    assert tree.parents == [ROOT, 0, 1, 0, ROOT, 4]
    tokens, parents = tree.window(last=42)
    assert tokens == [42, 5, 6, 7, 9, 4, 1] and parents == [-1, 0, 1, 2, 1, 0, 5]
    assert tree_depths(parents, len(parents)) == [0, 1, 2, 3, 2, 1, 2]


def test_topk_per_depth_makes_the_medusa_tree():
    tree = TokenTree.from_topk([[1, 2, 3], [4, 5], [6]], widths=[2, 2, 1])
    assert len(tree) == 2 + 4 + 4 and tree.max_depth == 3
    assert [tree.tokens[c] for c in tree.children(ROOT)] == [1, 2]
    assert all([tree.tokens[c] for c in tree.children(n)] == [4, 5] for n in tree.children(ROOT))


def test_pruning_keeps_a_tree_and_a_single_path_is_a_chain():
    tree = TokenTree.from_topk([[1, 2], [3, 4], [5]], widths=[2, 2, 1])
    cut = tree.pruned(depth=2, rows=5)
    assert len(cut) == 5 and cut.max_depth == 2 and cut.parents == [ROOT, ROOT, 0, 0, 1]
    chain = TokenTree.from_paths([[7, 8, 9]], widths=[1, 1, 1])
    assert chain.is_chain() and chain.chain() == [7, 8, 9]


def test_greedy_keeps_the_longest_agreeing_path_plus_the_target_token():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 9, 2], [4]], widths=[2, 2, 1])
    # window rows: 0 last, 1 '5', 2 '6', 3 '7', 4 '9', 5 '2', 6 '4'
    target = [5, 9, 0, 0, 2, 8, 0]  # after last: 5; after 5: 9; after 9: 2; after 2: 8
    v = verify_tree_greedy(tree, target)
    assert v.tokens == [5, 9, 2, 8] and v.accepted == 3
    assert v.path == [0, 1, 4, 5]
    assert fold_path(v.path, tree.window(0)[1], v.rows) == v.path  # a path the engine accepts
    miss = verify_tree_greedy(tree, [3, 0, 0, 0, 0, 0, 0])
    assert miss.tokens == [3] and miss.path == [0]
    with pytest.raises(ValueError):
        verify_tree_greedy(tree, [1, 2])


def markov_tree(prev: int, widths: list[int], sampled: bool, rng: np.random.Generator) -> TokenTree:
    """A tree of ``widths`` after ``prev``: children drawn without replacement from the drafter Q (their q kept),
    or fixed point-mass guesses."""
    tree = TokenTree()
    level = [(ROOT, prev)]
    for w in widths:
        nxt = []
        for node, tok in level:
            if sampled:
                kids = draw_without_replacement(Q[tok], w, rng)
                tree.child_q[node] = Q[tok]
            else:
                kids = [(tok + 1 + j) % 5 for j in range(w)]
            nxt += [(tree.add(node, k), k) for k in kids]
        level = nxt
    return tree


def first_two(widths: list[int], sampled: bool, rng: np.random.Generator, naive: bool = False) -> tuple[int, int]:
    out: list[int] = []
    while len(out) < 2:
        last = out[-1] if out else 0
        tree = markov_tree(last, widths, sampled, rng)
        window, _ = tree.window(last)
        if naive:  # a broken rule: the first child that passes min(1, p/q) against the unchanged p and q
            p = T[last]
            kid = next(
                (c for c in tree.children(ROOT) if rng.random() < min(1, p[tree.tokens[c]] / Q[last][tree.tokens[c]])),
                None,
            )
            out += [tree.tokens[kid]] if kid is not None else [int(rng.choice(5, p=p))]
            continue
        out += verify_tree_sampled(tree, T[window], rng).tokens
    return out[0], out[1]


@pytest.mark.parametrize("sampled", [False, True], ids=["point-mass", "drawn-without-replacement"])
def test_sampled_tree_verification_emits_the_target_distribution(sampled):
    """The joint law of the first two emitted tokens is T[0][a] * T[a][b], within a round and across rounds."""
    rng = np.random.default_rng(30 + sampled)
    counts = np.zeros((5, 5))
    for _ in range(TRIALS):
        a, b = first_two([3, 2], sampled, rng)
        counts[a, b] += 1
    assert_matches(counts, T[0][:, None] * T, tv_bound=0.02)


def test_the_check_catches_multi_draft_verification_without_the_residual():
    rng = np.random.default_rng(40)
    counts = np.zeros(5)
    for _ in range(TRIALS):
        a, _ = first_two([3], True, rng, naive=True)
        counts[a] += 1
    assert fails_check(counts, T[0])


def test_tree_rounds_count_their_rows_and_kept_depth():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 9, 2], [4]], widths=[2, 2, 1])
    stats = SpecStats()
    stats.record_tree(verify_tree_greedy(tree, [5, 9, 0, 0, 2, 8, 0]), tree.max_depth)
    stats.record_tree(verify_tree_greedy(tree, [3, 0, 0, 0, 0, 0, 0]), tree.max_depth)
    f = stats.figures()
    assert (f["rounds"], f["proposed"], f["accepted"], f["tree_rounds"]) == (2, 6, 3, 2)
    assert f["tree_rows"] == 6.0 and f["tree_depth"] == 1.5  # means per tree round
    assert f["rows_per_round"] == 7.0 and f["accepted_depth"] == 1.5
    assert SpecStats.from_summary(stats.summary()) == stats


def test_a_round_cuts_its_tree_to_the_room_and_capacity_left():
    from inferlet.spec.drafter import Proposal
    from inferlet.spec.drafting import fit_tree

    tree = TokenTree.from_topk([[1, 2], [3, 4], [5]], widths=[2, 2, 1])
    assert fit_tree(Proposal(tree=tree), depth=9, rows=99).tree is tree
    assert fit_tree(Proposal(tree=tree), depth=1, rows=99).tree.tokens == [1, 2]
    assert fit_tree(Proposal(tree=tree), depth=9, rows=0) == Proposal()
    chain = fit_tree(Proposal(tree=TokenTree.from_paths([[7, 8, 9]], [1, 1, 1])), depth=2, rows=99)
    assert chain.tree is None and chain.tokens == [7, 8]
