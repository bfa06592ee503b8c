"""The custom-inferlet examples run against a real engine and do what their docstrings say."""

from __future__ import annotations

from tests.conftest import REPO, run


def test_deferred_fold_example_equals_greedy(engine):
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"
    spec = run(str(REPO / "examples/deferred_fold.py"), engine.address, "--prompt", prompt, "--max-tokens", "16")
    plain = run("text-completion", engine.address, "--prompt", prompt, "--max-tokens", "16")
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["rounds"] < 16 and spec["accepted"] > 0  # some guesses were kept


def test_best_of_n_forks_share_the_prompt(engine):
    result = run(
        str(REPO / "examples/best_of_n.py"),
        engine.address,
        "--prompt",
        "Name a colour.",
        "--n",
        "3",
        "--max-tokens",
        "6",
        "--chat",
    )
    scores = [c["mean_logprob"] for c in result["candidates"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    assert result["best"] == result["candidates"][0]["text"]
