"""The suffix index (inferlet.spec.suffix_index) and the per-process registry it is shared through (inferlet.shared):
matches, candidate counts and scores, the store's eviction bound, and the build/save/load round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferlet import shared
from inferlet.spec.suffix_index import MAX_OCCURRENCES, SuffixIndex, main, read_corpus
from inferlet.spec.token_tree import ROOT


def test_match_finds_the_longest_earlier_suffix_not_itself():
    idx = SuffixIndex(min_match=2)
    doc = idx.add([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3])
    assert idx.match([5, 1, 2, 3]) == (3, [(doc, 2)])  # "1 2 3" at 0..2 (not the suffix itself, no follower)
    assert idx.match([4, 2, 3]) == (2, [(doc, 6), (doc, 2)])  # two occurrences of "2 3", newest first
    assert idx.match([1, 3]) == (0, [])
    assert idx.match([3]) == (0, [])  # shorter than min_match


def test_candidates_are_counted_and_scored_by_frequency():
    idx = SuffixIndex(min_match=1)
    for tail in ([7, 8], [7, 8], [7, 9], [6, 5]):
        idx.add([1, *tail])
    c = idx.candidates([0, 1], depth=2, rows=10, min_prob=0.0)
    assert (c.match_len, c.occurrences) == (1, 4)
    got = {(c.tree.tokens[n], c.tree.parents[n]): p for n, p in enumerate(c.probs)}
    seven = c.tree.children(ROOT)[0]
    assert c.tree.tokens[seven] == 7  # the most frequent first
    assert got[(7, ROOT)] == 0.75 and got[(6, ROOT)] == 0.25
    assert got[(8, seven)] == 0.5 and got[(9, seven)] == 0.25
    assert c.score == pytest.approx(0.75 + 0.25 + 0.5 + 0.25 + 0.25)
    assert c.chain() == ([7, 8], [0.75, 0.5])
    # parents come before their children (a TokenTree's order), and probabilities never rise down a path
    for n, parent in enumerate(c.tree.parents):
        assert parent < n and (parent == ROOT or c.probs[parent] >= c.probs[n])


def test_min_prob_rows_and_depth_cut_the_tree():
    idx = SuffixIndex(min_match=1)
    for tail in ([7, 8, 1], [7, 8, 2], [7, 9, 3], [6, 5, 4]):
        idx.add([1, *tail])
    c = idx.candidates([1], depth=3, rows=10, min_prob=0.5)
    assert c.tree.tokens == [7, 8] and c.probs == [0.75, 0.5]
    c = idx.candidates([1], depth=1, rows=10, min_prob=0.0)
    assert sorted(c.tree.tokens) == [6, 7]
    c = idx.candidates([1], depth=3, rows=2, min_prob=0.0)
    assert len(c.tree) == 2 and c.tree.tokens[0] == 7


def test_a_longer_match_outranks_a_frequent_shorter_one():
    idx = SuffixIndex(min_match=1)
    idx.add([5, 1, 2, 9])
    for _ in range(5):
        idx.add([3, 1, 2, 4])
    c = idx.candidates([5, 1, 2], depth=1, rows=4, min_prob=0.0)
    assert (c.match_len, c.occurrences, c.tree.tokens) == (3, 1, [9])


def test_a_growing_document_indexes_each_token_once_it_has_a_follower():
    idx = SuffixIndex(min_match=2)
    doc = idx.add([4, 5])
    assert idx.match([4, 5]) == (0, [])
    idx.extend(doc, [6, 4, 5])
    assert idx.candidates([4, 5], depth=4, rows=4).chain()[0] == [6, 4, 5]
    assert idx.tokens == 5


def test_the_store_evicts_the_least_recently_used_document_past_its_bound():
    idx = SuffixIndex(min_match=2, max_tokens=10)
    a = idx.add([1, 2, 3, 4])
    idx.add([5, 6, 7, 8])
    idx.candidates([1, 2], depth=2, rows=2)  # drafting from the first touches it
    idx.add([9, 10, 11])  # 11 tokens: the least recently used goes, the second document
    assert idx.tokens == 7 and idx.evicted == 1 and len(idx) == 2
    assert idx.documents() == [[1, 2, 3, 4], [9, 10, 11]]
    assert idx.match([5, 6])[1] == [] and idx.match([1, 2])[1] == [(a, 1)]
    for _ in range(50):
        idx.add(list(range(100, 104)))
        assert idx.tokens <= 10
    # no anchor of an evicted document is left behind
    live = {e >> 32 for entries in idx._anchors.values() for e in entries}
    assert live <= set(idx._docs)


def test_an_anchor_keeps_the_newest_occurrences():
    idx = SuffixIndex(min_match=1)
    doc = idx.add([1, 0] * (MAX_OCCURRENCES + 10))
    L, hits = idx.match([2, 1])
    assert L == 1 and len(hits) == MAX_OCCURRENCES and hits[0] == (doc, 2 * (MAX_OCCURRENCES + 9))


def test_save_and_load_round_trip(tmp_path: Path):
    idx = SuffixIndex(min_match=2)
    docs = [[1, 2, 3, 4], [5, 6, 70000, 8], [1, 2, 9]]
    for d in docs:
        idx.add(d)
    idx.save(tmp_path / "i.npz")
    back = SuffixIndex.load(tmp_path / "i.npz")
    assert back.documents() == docs and back.min_match == 2 and back.tokens == 11
    want = idx.candidates([0, 1, 2], depth=3, rows=8, min_prob=0.0)
    got = back.candidates([0, 1, 2], depth=3, rows=8, min_prob=0.0)
    assert (got.tree.tokens, got.tree.parents, got.probs) == (want.tree.tokens, want.tree.parents, want.probs)
    bounded = SuffixIndex.load(tmp_path / "i.npz", min_match=1, max_tokens=8)
    assert bounded.documents() == docs[1:] and bounded.min_match == 1
    (tmp_path / "bad.npz").write_bytes(b"not an index")
    with pytest.raises(ValueError):
        SuffixIndex.load(tmp_path / "bad.npz")


def test_build_from_a_corpus(tmp_path: Path):
    from pie_runtime.store import DEFAULT_MODEL, ModelStore

    tok = ModelStore().path(DEFAULT_MODEL) / "tokenizer.json"
    if not tok.exists():
        pytest.skip("the default model is not in the store")
    corpus = tmp_path / "c.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog.\n\nPack my box with five dozen liquor jugs.\n")
    assert read_corpus(corpus) == [
        "The quick brown fox jumps over the lazy dog.",
        "Pack my box with five dozen liquor jugs.",
    ]
    jl = tmp_path / "c.jsonl"
    jl.write_text(json.dumps({"text": "x y"}) + "\n" + json.dumps("z") + "\n")
    assert read_corpus(jl) == ["x y", "z"]
    assert main(["build", str(corpus), str(tmp_path / "out.npz"), "--tokenizer", str(tok)]) == 0
    idx = SuffixIndex.load(tmp_path / "out.npz")
    assert len(idx) == 2 and idx.tokens > 10
    first = idx.documents()[0]
    assert idx.candidates(first[:3], depth=4, rows=4, min_prob=0.0).chain()[0] == first[3:7]


def test_shared_objects_are_made_once_per_model_and_key():
    shared.forget()
    made = []

    def make():
        made.append(1)
        return object()

    a = shared.shared("m", "k", make)
    assert shared.shared("m", "k", make) is a and len(made) == 1
    assert shared.shared("other", "k", make) is not a and len(made) == 2
    shared.forget("m")
    assert shared.keys() == [("other", "k")]
    assert shared.shared("m", "k", make) is not a
    shared.forget()
    assert shared.keys() == []
