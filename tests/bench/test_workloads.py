"""The multi-request workloads of `pie bench speculation --workload`: seeded prompts of the right shape, and the
figures summed over requests (rates, tokens per forward, acceptance per position, ratios, greedy agreement, the
suffix store's memory), on made-up results."""

from __future__ import annotations

import pytest

from pie_runtime.bench.workload_report import compare, store_bytes_per_1000, summarize
from pie_runtime.bench.workloads import ITEMS, prompts


def test_prompts_are_seeded_and_shaped():
    a, b = prompts("json-facts", 64, seed=0), prompts("json-facts", 64, seed=0)
    assert a == b and len(a) == 64 and len(set(a)) == min(64, len(ITEMS))
    assert all('"fun_fact"' in p and "JSON object" in p for p in a)
    assert prompts("json-facts", 8, seed=1) != a[:8]
    code = prompts("code-classes", 64, seed=0)
    assert len(set(code)) == 64 and all("Python class named" in p and "code only" in p for p in code)
    assert code == prompts("code-classes", 64, seed=0) != prompts("code-classes", 64, seed=1)
    mixed = prompts("mixed-text", 32, seed=0)
    assert len(set(mixed)) == 32 and not any("JSON" in p for p in mixed)
    with pytest.raises(ValueError, match="no workload"):
        prompts("nope", 1)


def spec_result(ids: list[int], rate: float, proposed: list[int], accepted: list[int], skipped: int = 0) -> dict:
    rounds = proposed[0] if proposed else 0
    return {
        "token_ids": ids,
        "stats": {"decode_tokens_per_s": rate},
        "speculation": {
            "rounds": rounds,
            "proposed": sum(proposed),
            "accepted": sum(accepted),
            "proposed_per_position": proposed,
            "accepted_per_position": accepted,
            "reached_per_position": proposed,
            "rounds_with_rejection": 0,
            "skipped": {"no_draft": skipped} if skipped else {},
        },
    }


def test_figures_sum_over_requests():
    plain = [{"token_ids": list(range(11)), "stats": {"decode_tokens_per_s": 10.0}}] * 2
    spec = [
        spec_result(list(range(11)), 20.0, proposed=[4, 2], accepted=[3, 1], skipped=1),
        spec_result(list(range(11)), 40.0, proposed=[2], accepted=[2], skipped=2),
    ]
    other = [spec_result(list(range(11)), 10.0, [1], [0]), spec_result([9] * 11, 10.0, [1], [0])]
    s = summarize(spec)
    # 20 decode tokens over 10/20 + 10/40 s; forwards: 4 + 2 rounds and 1 + 2 plain steps
    assert s["decode_tokens_per_s"] == pytest.approx(20 / 0.75, abs=0.01)
    assert s["tokens_per_forward"] == pytest.approx(20 / 9, abs=1e-3)
    assert s["acceptance_per_position"] == [pytest.approx(5 / 6, abs=1e-3), 0.5]
    out = compare({"text-completion": plain, "cacheback": other, "suffix": spec})
    assert out["text-completion"]["tokens_per_forward"] == 1.0
    assert out["suffix"]["ratio_to_text_completion"] == pytest.approx(2.667, abs=1e-3)
    assert out["suffix"]["ratio_to_cacheback"] == pytest.approx(2.667, abs=1e-3)
    assert out["suffix"]["greedy_match"] == "2/2" and out["cacheback"]["greedy_match"] == "1/2"


def test_store_memory_is_measured_and_scales():
    small = store_bytes_per_1000([list(range(i, i + 100)) for i in range(10)])
    assert small["tokens"] == 1000 and 20 < small["bytes_per_token"] < 1000
    assert small["mib_per_1000_requests"] == pytest.approx(small["bytes_per_token"] * 100 * 1000 / 2**20, rel=0.01)
