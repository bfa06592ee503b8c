"""`pie bench speculation` end to end on the tiny model: the policy against text-completion, or against
itself at draft length 0, with digests that show whether the greedy tokens matched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import TINY

PROMPT = "one two three four one two three four one two three four one two"


@pytest.fixture
def bench(pie_home, tmp_path):
    def go(*extra: str, prompts: tuple[str, ...] = (PROMPT,)) -> list[dict]:
        files = []
        for i, text in enumerate(prompts):
            files += ["--prompt", str(tmp_path / f"prompt{i}.txt")]
            (tmp_path / f"prompt{i}.txt").write_text(text)
        cmd = [
            sys.executable,
            "-m",
            "pie_runtime.cli.main",
            "bench",
            "speculation",
            "--model",
            TINY,
            *files,
            "--max-tokens",
            "24",
            "--json",
            *extra,
        ]
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PIE_HOME": str(pie_home)}
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]

    return go


def test_against_text_completion(bench):
    engine = ["--engine-arg=--weights", "--engine-arg=fp32", "--engine-arg=--threads", "--engine-arg=1"]
    (row,) = bench("--inferlet", "cacheback-speculative-decoding", "--timing", *engine)
    assert row["weights"] == {TINY: "fp32"} and row["threads"] == 1  # what the figures were measured on
    assert row["control"] == "text-completion" and row["greedy_match"] is True
    assert row["digest"] == row["text_completion_digest"]
    assert row["generated_tokens"] == 24 and row["speed_ratio"] > 0 and row["rounds"] > 0
    assert row["round_ms_mean"] > 0


def test_against_the_same_inferlet_at_draft_length_zero(bench):
    (row,) = bench(
        "--inferlet",
        "constrained-speculative-decoding",
        "--control",
        "draft-length-0",
        "--",
        "--regex",
        "(one |two |three |four )+",
    )
    assert row["control"] == "draft-length-0" and "text_completion_tokens_per_s" not in row
    assert row["weights"] == {TINY: "int4"}  # the engine's default format
    assert row["greedy_match"] is True and row["digest"] == row["control_digest"]


def test_two_prompts_with_turns_on_one_engine(bench):
    rows = bench(
        "--inferlet", "cacheback-speculative-decoding", "--repeats", "2", prompts=(PROMPT, "a b c d a b c d a b")
    )
    assert [r["prompt"].endswith(f"prompt{i}.txt") for i, r in enumerate(rows)] == [True, True]
    for row in rows:
        assert row["repeats"] == 2 and row["greedy_match"] is True
        low, high = row["speed_ratio_range"]
        assert 0 < low <= row["speed_ratio"] <= high
    assert rows[0]["digest"] != rows[1]["digest"]
