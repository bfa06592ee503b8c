"""Tree speculation end to end on the real default model (fp32, as every spec_engine test): greedy output of
every tree inferlet equals text-completion's token for token on several prompts, while tree rounds run."""

from __future__ import annotations

import pytest

from tests.drafter_fixtures import MTP_DEPTH
from tests.inferlets.conftest import SLICE, call_many
from tests.inferlets.test_speculative_inferlets import MAX, PROMPTS

TREES = [
    ("cacheback-speculative-decoding", {"tree": "4,2,1,1,1,1", "draft_schedule": "fixed"}),
    ("cacheback-speculative-decoding", {"tree": "3,1,1,1"}),  # the planner chooses chain or tree
    ("mtp-speculative-decoding", {"tree": ",".join(["3", "2", "1", "1"][:MTP_DEPTH]), "draft_length": MTP_DEPTH}),
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
