"""Prompt lookup drafting: most-recent-occurrence rule, n-gram fallback, the index agreeing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlet.spec.ngram_lookup import NgramIndex, lookup_drafts


def both(tokens, max_ngram, min_ngram, k):
    got = lookup_drafts(tokens, max_ngram, min_ngram, k)
    assert NgramIndex(max_ngram, min_ngram, tokens).draft(k) == got
    return got


def test_most_recent_occurrence_wins():
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 8, 8, 1, 2, 9, 9, 5, 1, 2]
    assert both(tokens, 2, 1, 3) == [9, 9, 5]


def test_longer_ngram_beats_more_recent_shorter_one():
    # [5, 1, 2] occurs at 0..2 (followed by 7); [1, 2] alone more recently at 5..6 (followed by 3).
    tokens = [5, 1, 2, 7, 7, 1, 2, 3, 5, 1, 2]
    assert both(tokens, 3, 1, 2) == [7, 7]
    assert both(tokens, 2, 1, 2) == [3, 5]


def test_falls_back_to_shorter_ngram():
    tokens = [4, 2, 6, 6, 3, 2]
    assert both(tokens, 3, 1, 2) == [6, 6]
    assert both(tokens, 3, 2, 2) == []


def test_k_cuts_the_continuation():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert both(tokens, 2, 1, 3) == [3, 4, 5]
    assert both(tokens, 2, 1, 1) == [3]
    assert both(tokens, 2, 1, 0) == []


def test_short_continuation_near_the_end_is_returned():
    # The most recent [7, 7] ends one before the suffix: overlapping, one token follows it.
    assert both([7, 7, 7], 2, 2, 4) == [7]
    assert both([3, 1, 3], 1, 1, 5) == [1, 3]


def test_no_match():
    assert both([1, 2, 3, 4], 3, 1, 4) == []
    assert both([], 3, 1, 4) == []
    assert both([5], 3, 1, 4) == []


def test_suffix_itself_is_not_a_match():
    assert both([9, 1, 2], 2, 2, 3) == []


def test_index_extends_incrementally():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]
    index = NgramIndex(3, 1)
    for i, tok in enumerate(tokens):
        index.extend([tok])
        assert index.draft(3) == lookup_drafts(tokens[: i + 1], 3, 1, 3)
    assert len(index) == len(tokens)
    assert index.draft(3) == [3, 5, 1]


def test_bad_ngram_range():
    with pytest.raises(ValueError):
        lookup_drafts([1, 2], 1, 2, 3)
    with pytest.raises(ValueError):
        NgramIndex(2, 0)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    max_ngram=st.integers(1, 5),
    min_ngram=st.integers(1, 5),
    k=st.integers(0, 6),
    split=st.integers(0, 60),
)
def test_index_agrees_with_function_on_random_sequences(tokens, max_ngram, min_ngram, k, split):
    min_ngram = min(min_ngram, max_ngram)
    index = NgramIndex(max_ngram, min_ngram, tokens[:split])
    index.extend(tokens[split:])
    want = brute_force(tokens, max_ngram, min_ngram, k)
    assert lookup_drafts(tokens, max_ngram, min_ngram, k) == want
    assert index.draft(k) == want


def brute_force(tokens, max_ngram, min_ngram, k):
    n_tokens = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > n_tokens:
            continue
        suffix = tokens[n_tokens - n :]
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_long_sequence_agrees_and_is_fast():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=4000).tolist()
    tokens += tokens[1000:1100]  # a repeated passage, as when a model quotes its prompt
    index = NgramIndex(4, 1, tokens[:3000])
    for i in range(3000, len(tokens)):
        want = lookup_drafts(tokens[:i], 4, 1, 5)
        assert index.draft(5) == want
        index.extend([tokens[i]])
    assert index.draft(5) == tokens[1100:1105]


def test_tree_paths_are_several_occurrences_longest_match_first():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 7, 3, 2, 8, 1, 2, 9, 4, 1, 2]
    index = NgramIndex(2, 1, tokens)
    # [1, 2] ends at 7 (→ 9 4) and at 1 (→ 7 3), newest first; then [2] alone ends at 4 (→ 8 1)
    assert index.draft_paths(2, 5) == [[9, 4], [7, 3], [8, 1]]
    assert index.draft_paths(2, 1) == [index.draft(2)]
