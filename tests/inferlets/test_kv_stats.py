"""Every decoding inferlet's ``--json`` stats say what KV its working set held (issue 56): ``kv_pages`` and
``kv_pages_max`` beside ``kv_bytes`` and ``kv_bytes_max``, the pages times the model's ``page_bytes`` (one page
group here), held at the end no more than at most. The drafter inferlets that need an attached head or draft
model report through the same round loop (``inferlet.spec``), checked in test_speculative_inferlets."""

from __future__ import annotations

import pytest

from tests.conftest import in_session, run

PROMPT = ["--prompt", "one two three four five six. one two three four five six. one two", "--max-tokens", "24"]
RUNS = [
    ("text-completion", []),
    ("text-completion", ["--temperature", "0.8", "--seed", "3"]),  # the host loop
    ("cacheback-speculative-decoding", []),
    ("suffix-speculative-decoding", []),
    ("constrained-speculative-decoding", ["--regex", "[a-z ]+"]),
    ("streaming-llm", ["--sinks", "4", "--window", "24"]),
    ("h2o", ["--budget", "32", "--recent", "8"]),
]


@pytest.mark.parametrize("name,extra", RUNS, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_decoding_inferlets_report_kv_bytes(tiny_engine, name, extra):
    async def page_bytes(model) -> int:
        return model.info.page_bytes

    unit = in_session(tiny_engine.address, page_bytes)
    assert unit > 0
    s = run(name, tiny_engine.address, *PROMPT, *extra)["stats"]
    assert s["kv_pages_max"] >= s["kv_pages"] >= 0 and s["kv_pages_max"] > 0
    assert s["kv_bytes"] == s["kv_pages"] * unit
    assert s["kv_bytes_max"] == s["kv_pages_max"] * unit
