"""The guarantee in every weight format: each speculative inferlet's greedy tokens equal text-completion's on
the same engine (bf16, int8, int4; fp32 is test_speculative_inferlets.py), and constrained decoding's equal its
own plain masked decode. Drafts are fixed-length here, so that every round verifies a multi-row window
whatever the pass-cost planner would pick on a loaded machine."""

from __future__ import annotations

import json

import pytest

from pie_runtime.store import DEFAULT_MODEL
from tests.conftest import start_engine
from tests.drafter_fixtures import MTP_DEPTH
from tests.inferlets.conftest import SLICE, call_many
from tests.inferlets.test_constrained import CITY, PERSON

PROMPTS = [
    {
        "prompt": "Repeat after me: the quick brown fox jumps over the lazy dog. "
        "The quick brown fox jumps over the lazy dog. The quick brown"
    },
    {"prompt": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"},
    {"prompt": "Once upon a time, there was a little girl named Emma who loved to play"},
    {"prompt": "What is 2+2? Answer with just the number.", "chat": True},  # ends with EOS
]
MAX = 32
FIXED = {"draft_schedule": "fixed"}
POLICIES = [
    ("cacheback-speculative-decoding", {**FIXED, "draft_length": 6}),
    ("draft-model-speculative-decoding", {**FIXED, "draft": SLICE, "draft_length": 4}),
    ("mtp-speculative-decoding", {**FIXED, "draft_length": MTP_DEPTH}),
]


@pytest.fixture(scope="module", params=["bf16", "int8", "int4"])
def format_engine(request, spec_home):
    # drafts are fixed-length here, so the engine needs no pass-cost curve (timing bf16's is 10 s on 2 cores)
    eng = start_engine(
        spec_home, [DEFAULT_MODEL, SLICE], "--kv-pages", "1024", "--weights", request.param, "--pass-cost-rows", "0"
    )
    yield eng
    eng.stop()


def test_every_speculative_inferlet_equals_text_completion(format_engine):
    want = call_many(format_engine.address, "text-completion", [{**p, "max_tokens": MAX} for p in PROMPTS])
    for name, extra in POLICIES:
        got = call_many(format_engine.address, name, [{**p, "max_tokens": MAX, **extra} for p in PROMPTS])
        for w, g in zip(want, got):
            assert g["token_ids"] == w["token_ids"], name
            assert g["finish_reason"] == w["finish_reason"], name
        assert sum(r["stats"]["proposed"] for r in got) > 0, name  # windows of several rows were verified
        if name.startswith("cacheback"):
            assert got[0]["stats"]["accepted"] > 0  # the repetitive prompt: lookup drafts are kept


def test_constrained_equals_its_plain_masked_decode(format_engine):
    cases = [
        {"json_schema": json.dumps(PERSON), "prompt": "Give a JSON object for a person named Alice who is 30."},
        {"json_schema": json.dumps(CITY), "prompt": "Describe Paris as JSON."},
    ]
    name = "constrained-speculative-decoding"
    plain = call_many(format_engine.address, name, [{**c, "max_tokens": 48, "draft_length": 0} for c in cases])
    spec = call_many(format_engine.address, name, [{**c, "max_tokens": 48} for c in cases])
    for p, s in zip(plain, spec):
        assert s["token_ids"] == p["token_ids"]
        json.loads(s["text"])
