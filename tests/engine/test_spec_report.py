"""The engine sums the counters of finished speculative runs per model and inferlet, under the names a
run's own stats use; a report that contradicts itself is refused with a typed error and changes nothing."""

from __future__ import annotations

import pytest

from pie_runtime.protocol import ErrorCode, PieError
from tests.conftest import TINY, run

PROMPT = "ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab"
NAME = "cacheback-speculative-decoding"


async def totals(model) -> dict:
    spec = (await model.client.request("stats"))["speculation"]
    return spec.get(TINY, {}).get(NAME, {"runs": 0, "rounds": 0, "proposed": 0, "accepted": 0, "skipped": {}})


async def test_finished_runs_are_summed_under_their_inferlet(tiny, tiny_engine):
    before = await totals(tiny)
    results = [run(NAME, tiny_engine.address, "--prompt", PROMPT, "--max-tokens", str(n)) for n in (12, 20)]
    after = await totals(tiny)
    assert after["runs"] == before["runs"] + 2
    for key in ("rounds", "proposed", "accepted"):
        assert after[key] == before[key] + sum(r["stats"][key] for r in results)
    assert after["acceptance"] == after["accepted"] / after["proposed"]
    assert len(after["acceptance_per_position"]) >= max(len(r["stats"]["acceptance_per_position"]) for r in results)
    for i, (a, r, p) in enumerate(
        zip(after["accepted_per_position"], after["reached_per_position"], after["proposed_per_position"])
    ):  # a round reaches a position only if it proposed it, and keeps it only if it reached it
        assert a <= r <= p and after["acceptance_given_kept"][i] == (a / r if r else 0.0)
    assert after["decode_tokens_per_s"] > 0


@pytest.mark.parametrize(
    "bad",
    [
        {"proposed": 2, "accepted": 3},
        {
            "proposed": 3,
            "accepted": 1,
            "proposed_per_position": [1],
            "accepted_per_position": [2],
            "reached_per_position": [2],
        },
        {
            "proposed": 3,
            "accepted": 1,
            "proposed_per_position": [1, 1],
            "accepted_per_position": [1],
            "reached_per_position": [1],
        },
        {"proposed": 3, "accepted": 1, "proposed_per_position": [1], "accepted_per_position": [1]},  # no reached
        {  # kept in more rounds than reached the position
            "proposed": 3,
            "accepted": 1,
            "proposed_per_position": [2],
            "accepted_per_position": [2],
            "reached_per_position": [1],
        },
        {"proposed": 3, "accepted": 1, "rounds_with_rejection": 9},
    ],
)
async def test_inconsistent_reports_are_refused(tiny, bad):
    before = await totals(tiny)
    fields = {"model": TINY, "inferlet": NAME, "rounds": 2, "rounds_with_rejection": 0, **bad}
    with pytest.raises(PieError) as e:
        await tiny.client.request("spec_report", **fields)
    assert e.value.code == ErrorCode.BAD_MESSAGE
    assert await totals(tiny) == before


async def test_reports_at_the_limit_never_break_stats_and_past_it_are_refused(tiny):
    top = 2**53 - 1
    fields = {"model": TINY, "inferlet": "at-the-limit", "rounds_with_rejection": 0}
    for too_big in ({"rounds": 2**64 - 1}, {"rounds": 2**53}, {"decode_s": float("inf")}):
        with pytest.raises(PieError) as e:
            await tiny.client.request("spec_report", **{**fields, "rounds": 1, "proposed": 1, "accepted": 0, **too_big})
        assert e.value.code == ErrorCode.BAD_MESSAGE
    for _ in range(2):
        await tiny.client.request("spec_report", **fields, rounds=top, proposed=top, accepted=top)
    t = (await tiny.client.request("stats"))["speculation"][TINY]["at-the-limit"]
    assert t["runs"] >= 2 and t["rounds"] >= 2 * top and t["acceptance"] == 1.0
