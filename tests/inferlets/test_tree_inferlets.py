"""Tree speculation end to end on the real default model: greedy output of every tree inferlet equals
text-completion's token for token on several prompts while tree rounds run, in fp32 (the spec_engine, as
every speculative inferlet test) and, for prompt lookup, in int4 (the default format)."""

from __future__ import annotations

import asyncio

import pytest

from pie_runtime.store import DEFAULT_MODEL
from tests.conftest import start_engine
from tests.drafter_fixtures import MTP_DEPTH
from tests.inferlets.conftest import SLICE, call_many
from tests.inferlets.test_speculative_inferlets import (
    MAX,
    PROMPTS,
    SAMPLE_PROMPT,
    TEMP,
    TOP_K,
    N,
    _assert_follows,
    _target_probs,
)

TREES = [
    ("cacheback-speculative-decoding", {"tree": "4,2,1,1,1,1", "draft_schedule": "fixed"}),
    ("cacheback-speculative-decoding", {"tree": "3,1,1,1"}),  # the planner chooses chain or tree
    (
        "mtp-speculative-decoding",
        {"tree": ",".join(["3", "2", "1", "1"][:MTP_DEPTH]), "draft_length": MTP_DEPTH, "draft_schedule": "fixed"},
    ),
    ("draft-model-speculative-decoding", {"draft": SLICE, "tree": "2,2,1", "draft_schedule": "fixed"}),
]


@pytest.fixture(scope="module")
def reference(spec_engine) -> list[dict]:
    return call_many(spec_engine.address, "text-completion", [{**p, "max_tokens": MAX} for p in PROMPTS])


@pytest.mark.parametrize("name,extra", TREES, ids=lambda v: v if isinstance(v, str) else str(v))
def test_greedy_tree_equals_text_completion(spec_engine, reference, name, extra):
    got = call_many(spec_engine.address, name, [{**p, "max_tokens": MAX, **extra} for p in PROMPTS])
    for want, res in zip(reference, got):
        assert res["token_ids"] == want["token_ids"]
        assert (res["text"], res["finish_reason"]) == (want["text"], want["finish_reason"])
    stats = [r["stats"] for r in got]
    assert sum(s["tree_rounds"] for s in stats) > 0
    assert all(s["tree_rows"] >= 1.0 for s in stats if s["tree_rounds"])
    if extra.get("draft_schedule") == "fixed":
        assert sum(s["accepted"] for s in stats) > 0


@pytest.fixture(scope="module")
def int4_engine(pie_home):
    """The default model in the default weight format (int4: bf16 activations, batch-invariant attention), with
    no pass-cost curve: its test drafts a fixed tree."""
    eng = start_engine(pie_home, [DEFAULT_MODEL], "--weights", "int4", "--pass-cost-rows", "0")
    yield eng
    eng.stop()


def test_int4_greedy_tree_equals_text_completion(int4_engine):
    """Outside fp32 the guarantee rests on batch invariance: a tree row gets the bits of the same row decoded
    alone along its path, so the tree's greedy text is text-completion's on the same engine."""
    prompts = PROMPTS[:3]
    want = call_many(int4_engine.address, "text-completion", [{**p, "max_tokens": MAX} for p in prompts])
    extra = {"tree": "4,2,1,1,1,1", "draft_schedule": "fixed"}
    got = call_many(
        int4_engine.address, "cacheback-speculative-decoding", [{**p, "max_tokens": MAX, **extra} for p in prompts]
    )
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    assert sum(r["stats"]["tree_rounds"] for r in got) > 0


@pytest.mark.parametrize(
    "name,extra",
    [
        ("cacheback-speculative-decoding", {"tree": "3,1,1"}),  # point-mass children
        ("draft-model-speculative-decoding", {"draft": SLICE, "tree": "3,2"}),  # drawn: recursive rejection
    ],
)
def test_sampled_tree_tokens_follow_the_target(spec_engine, name, extra):
    """The first token, and the second (from a tree round) given the most common first, follow the target's
    distribution; the statistical test of the verifier itself is tests/sdk/test_tree.py."""
    extra = {**extra, "draft_schedule": "fixed"}
    runs = call_many(
        spec_engine.address,
        name,
        [
            {"prompt": SAMPLE_PROMPT, "max_tokens": 3, "temperature": TEMP, "top_k": TOP_K, "seed": s, **extra}
            for s in range(N)
        ],
    )
    firsts = [r["token_ids"][0] for r in runs]
    _, p1 = asyncio.run(_target_probs(spec_engine.address, []))
    _assert_follows(firsts, p1)
    x = max(set(firsts), key=firsts.count)
    seconds = [r["token_ids"][1] for r in runs if r["token_ids"][0] == x and len(r["token_ids"]) > 1]
    assert len(seconds) >= N // 3
    _, p2 = asyncio.run(_target_probs(spec_engine.address, [x]))
    _assert_follows(seconds, p2)
    if name.startswith("draft-model"):  # a draft model always has a tree to verify
        assert all(r["stats"]["tree_rounds"] > 0 for r in runs)
