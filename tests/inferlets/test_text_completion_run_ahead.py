"""text-completion --run-ahead through the real launcher: greedy output equals the host-driven loop,
stop strings and the token limit end it, and a seeded sampled run is reproducible."""

from __future__ import annotations

from tests.conftest import run


def test_greedy_run_ahead_equals_the_host_loop_on_the_default_model(engine):
    words = ["--prompt", "Name three colours.", "--chat", "--max-tokens", "24"]
    host = run("text-completion", engine.address, *words)
    ahead = run("text-completion", engine.address, *words, "--run-ahead")
    assert ahead["token_ids"] == host["token_ids"] and ahead["finish_reason"] == host["finish_reason"]
    assert ahead["text"] == host["text"]


def test_run_ahead_ends_at_a_stop_string_and_at_max_tokens(tiny_engine):
    base = ["--prompt", "Once upon a time", "--max-tokens", "30"]
    host = run("text-completion", tiny_engine.address, *base)
    ahead = run("text-completion", tiny_engine.address, *base, "--run-ahead")
    assert ahead["token_ids"] == host["token_ids"] and len(ahead["token_ids"]) == 30
    stop = host["text"].split()[3]
    cut = run("text-completion", tiny_engine.address, *base, "--stop", stop, "--run-ahead")
    assert (
        cut["finish_reason"] == "stop"
        and cut["text"] == run("text-completion", tiny_engine.address, *base, "--stop", stop)["text"]
    )


def test_seeded_sampled_run_ahead_is_reproducible(tiny_engine):
    words = ["--prompt", "Once upon a time", "--max-tokens", "12", "--temperature", "0.9", "--seed", "5", "--run-ahead"]
    a = run("text-completion", tiny_engine.address, *words)
    b = run("text-completion", tiny_engine.address, *words)
    c = run("text-completion", tiny_engine.address, *words[:-2], "6", "--run-ahead")
    assert a["token_ids"] == b["token_ids"] != c["token_ids"]
