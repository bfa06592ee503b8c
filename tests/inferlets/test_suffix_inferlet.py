"""suffix-speculative-decoding on the real default model: greedy runs equal text-completion token for token
(chains, token trees, with and without the cross-request store), two runs in one process share the store (a
repeated request drafts from the first one's output), and a store saved by one run starts another's."""

from __future__ import annotations

import pytest

import inferlet.shared
from pie_runtime.store import DEFAULT_MODEL
from tests.conftest import start_engine
from tests.inferlets.conftest import call, call_many
from tests.inferlets.test_speculative_inferlets import MAX, PROMPTS

NAME = "suffix-speculative-decoding"
FRESH = "Describe a red apple in one JSON object with the fields name, color, taste and price:"


@pytest.fixture(scope="module")
def suffix_engine(pie_home):
    """The default model with room for many rows and no pass-cost curve (the planner then drafts what the
    drafter offers, so what is asserted does not hang on costs timed on a busy machine)."""
    eng = start_engine(pie_home, [DEFAULT_MODEL], "--kv-pages", "1024", "--pass-cost-rows", "0")
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def reference(suffix_engine) -> list[dict]:
    return call_many(suffix_engine.address, "text-completion", [{**p, "max_tokens": MAX} for p in PROMPTS])


@pytest.mark.parametrize(
    "extra",
    # the suite's budget: the chain and the tree (no store: test_two_runs_... checks it; fixed: as the chain)
    [{}, {"tree_rows": 8}],
    ids=str,
)
def test_greedy_equals_text_completion(suffix_engine, reference, extra):
    inferlet.shared.forget()
    for _ in range(2):  # the second pass drafts from the store the first filled, too
        got = call_many(suffix_engine.address, NAME, [{**p, "max_tokens": MAX, **extra} for p in PROMPTS])
        for want, res in zip(reference, got):
            assert res["token_ids"] == want["token_ids"]
            assert (res["text"], res["finish_reason"]) == (want["text"], want["finish_reason"])
        assert sum(r["stats"]["proposed"] for r in got) > 0
        assert sum(r["stats"]["accepted"] for r in got) > 0
    if extra.get("store_tokens") == 0:
        assert all(r["suffix"]["drafted_from"]["store"] == 0 for r in got)
    else:
        assert sum(r["suffix"]["drafted_from"]["store"] for r in got) > 0
    if "tree_rows" in extra:
        assert sum(r["stats"].get("tree_rounds", 0) for r in got) > 0


def test_two_runs_in_one_process_share_the_store(suffix_engine):
    """The second run of a request drafts from the first's output (kept in the store the process shares):
    more drafts kept, fewer rounds, the same tokens; the store holds the first output."""
    inferlet.shared.forget()
    args = {"prompt": FRESH, "max_tokens": 48}
    first = call(suffix_engine.address, NAME, **args)
    assert first["suffix"]["store_documents"] == 1
    assert first["suffix"]["store_tokens"] == len(first["token_ids"])
    second = call(suffix_engine.address, NAME, **args)
    assert second["token_ids"] == first["token_ids"]
    assert second["suffix"]["drafted_from"]["store"] > 0
    s1, s2 = first["stats"], second["stats"]
    assert s2["accepted"] > s1["accepted"] + 10 and s2["rounds"] < s1["rounds"]
    alone = call(suffix_engine.address, NAME, **args, store_tokens=0)  # no store: drafts from the prompt only
    assert alone["stats"]["accepted"] < s2["accepted"]


def test_a_saved_store_starts_another(suffix_engine, tmp_path):
    inferlet.shared.forget()
    path = tmp_path / "store.npz"
    args = {"prompt": FRESH, "max_tokens": 32}
    first = call(suffix_engine.address, NAME, **args, save_index=str(path))
    assert path.exists()
    inferlet.shared.forget()  # a new process, as far as the registry knows
    second = call(suffix_engine.address, NAME, **args, suffix_index=str(path))
    assert second["token_ids"] == first["token_ids"]
    assert second["suffix"]["store_documents"] == 2  # the loaded output and this run's
    assert second["suffix"]["drafted_from"]["store"] > 0 and second["stats"]["accepted"] > first["stats"]["accepted"]


def test_sampled_runs_are_seeded_and_speculate(suffix_engine):
    inferlet.shared.forget()
    args = {"prompt": PROMPTS[1]["prompt"], "max_tokens": 24, "temperature": 0.8, "top_k": 20, "seed": 3}
    a = call(suffix_engine.address, NAME, **args, store_tokens=0)
    b = call(suffix_engine.address, NAME, **args, store_tokens=0)
    assert a["token_ids"] == b["token_ids"] and a["stats"]["proposed"] > 0
