"""The custom-inferlet examples run against a real engine and do what their docstrings say."""

from __future__ import annotations

import pytest

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


@pytest.mark.e2e
def test_tutorial_drafter_honours_n(engine):
    """speculate runs ``--n`` choices on forks of the prompt, each with its own copy of the tutorial's drafter:
    greedy, every choice is text-completion's text; sampled, four choices, the first the run's own."""
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"
    words = ["--prompt", prompt, "--max-tokens", "16"]
    plain = run("text-completion", engine.address, *words)
    greedy = run(str(REPO / "examples/bigram_drafter.py"), engine.address, *words, "--n", "4")
    assert [c["token_ids"] for c in greedy["choices"]] == [plain["token_ids"]] * 4
    assert greedy["speculation"]["accepted"] > 0 and greedy["stats"]["generated_tokens"] == 4 * len(plain["token_ids"])
    sampled = run(
        str(REPO / "examples/bigram_drafter.py"),
        engine.address,
        *words,
        "--n",
        "4",
        "--temperature",
        "0.9",
        "--seed",
        "5",
    )
    assert len(sampled["choices"]) == 4 and sampled["choices"][0]["token_ids"] == sampled["token_ids"]


def test_fuzz_engine_imports_without_running_and_its_cases_are_seeded():
    """examples/fuzz_engine.py is a module (tests/engine/test_fuzz.py runs it): importing it starts nothing,
    and a seed fixes every hostile message it builds."""
    import random

    import zmq

    from examples import fuzz_engine as fz

    handles = fz.Handles("m", 49152, [1, 2, 3], [4, 5], "0" * 32, foreign_ws=9, foreign_channel=10)

    def build(seed: int) -> list[bytes]:
        ctx = zmq.Context()
        conn = fz.Conn(ctx, "ipc:///nonexistent-fuzz.sock", lambda: True)
        rng = random.Random(seed)
        try:
            return [m.payload for kind in sorted(fz.KINDS) for m in fz.KINDS[kind][0](conn, handles, rng)]
        finally:
            conn.close()
            ctx.term()

    assert build(3) == build(3) and build(3) != build(4)
    assert {"random_bytes", "wrong_types", "huge_numbers", "foreign_handles", "lying_arrays"} <= set(fz.KINDS)
    assert {"deep_program", "huge_program", "sampler_extremes", "huge_readout", "flood"} <= set(fz.KINDS)


def test_replay_planner_replays_schedules_on_a_traced_greedy_decode(engine):
    """trace_head.py's column 0 is the greedy decode and its other columns the head's chain; replaying a
    schedule on it drafts from that chain, and a head that is always right makes every round as wide as asked."""
    from examples.drafters import replay_planner as rp

    prompt = "1, 2, 3, 1, 2, 3, 1, 2,"
    out = run(
        str(REPO / "examples/drafters/trace_head.py"),
        engine.address,
        "--prompt",
        prompt,
        "--max-tokens",
        "12",
        "--depth",
        "2",
    )
    plain = run("text-completion", engine.address, "--prompt", prompt, "--max-tokens", "12")
    trace = rp.Trace.from_result("count", out)
    assert trace.tokens == plain["token_ids"] and all(len(d) == 2 for d in trace.drafts)
    for adaptive in (False, True):
        speedup, rows = rp.replay(trace, 2, adaptive)
        assert speedup > 0 and 1 <= rows <= 3
    right = rp.Trace("right", list(range(61)), [[i + 1, i + 2] for i in range(61)], [20.0, 21.0, 22.0], 0.5, 2.0)
    speedup, rows = rp.replay(right, 2, adaptive=False)
    assert rows == 3 and speedup == pytest.approx(60 * 22.0 / (20 * (22.0 + 2 * 0.5 + 2.0)))
    assert rp.replay(right, 2, adaptive=True)[1] > 2.5  # the planner widens to what keeps being kept


def test_bench_prompt_cache_loads_and_recomputes_the_same_first_token(engine, tmp_path):
    """examples/bench_prompt_cache.py's two paths, on a short prompt from a corpus written here: the saved rows
    loaded and the prefill computed again reach the same greedy first token, once timed each after a warm-up."""
    import asyncio

    from examples import bench_prompt_cache as bench

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("It is a truth universally acknowledged, that a single man in possession of a fortune " * 8)
    path = tmp_path / "prompt.kv"
    ids = asyncio.run(bench.save(engine.address, corpus, 48, path))
    timings = asyncio.run(bench.measure(engine.address, engine.proc.pid, ids, path, 1))
    assert len(ids) == 48 and path.stat().st_size > 47 * 30 * 2 * 3 * 64 * 4  # 47 rows of fp32 K and V
    load, recompute = timings["load"], timings["recompute"]
    assert load.tokens == recompute.tokens and len(load.tokens) == 1
    assert len(load.wall) == len(recompute.cpu) == 1 and min(load.cpu + recompute.cpu) >= 0


@pytest.mark.e2e
def test_soak_serve_quick_leaks_nothing(pie_home, tmp_path):
    """examples/soak_serve.py for 20 s against a `pie serve` it starts (tiny model, the default model's chat
    template), its engine SIGKILLed 8 s in: every kind of request went out, nothing answered that should not
    have (no 5xx but the kill's engine_lost and engine_restarting, no dropped connection, no bad request
    accepted), a new engine served, the KV pages are back to their start value and it says FLAT or why not."""
    import json
    import os
    import subprocess
    import sys

    from pie_runtime.store import DEFAULT_MODEL, ModelStore
    from tests.conftest import TINY

    template = tmp_path / "chat.jinja"
    template.write_text(ModelStore(pie_home / "models").get(DEFAULT_MODEL).tokenizer.chat_template or "")
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "examples/soak_serve.py"), "--seconds", "20", "--model", TINY]
    cmd += ["--oversize-bytes", "70000", "--kill-engine-after", "8", "--json", str(out), "--"]
    cmd += ["--chat-template", str(template), "--kv-pages", "256", "--pass-cost-rows", "0", "--max-body-bytes", "65536"]
    done = subprocess.run(cmd, env={**os.environ, "PIE_HOME": str(pie_home)}, capture_output=True, text=True, cwd=REPO)
    rep = json.loads(out.read_text())
    assert set(rep["sent"]) == {"stream", "whole", "cancel", "oversized", "malformed"}, done.stdout
    assert rep["unexpected"] == {}, done.stdout
    fives = {k.split()[2] for k in rep["outcomes"] if k.split()[1].startswith("5") or "+error" in k.split()[1]}
    assert fives <= {"engine_lost", "engine_restarting"}
    kill = rep["engine_kill"]
    assert kill["restarted"] and kill["new_pid"] != kill["pid"] and kill["health"]["engine"]["restarts"] == 1
    assert rep["end"]["procs"]["engine"]["pid"] == kill["new_pid"]
    assert rep["end"]["pages_used"] == rep["start"]["pages_used"]
    assert {"server", "engine", "hosts"} <= set(rep["start"]["procs"])
    assert "verdict: " in done.stdout and (done.returncode == 0) == rep["flat"]


def test_streams_example_decodes_each_prompt_as_text_completion(engine, tmp_path):
    """examples/streams.py (the many-stream side of examples/bench_streams_openvino.py): three different prompts
    decoded at once in one inferlet process give each one text-completion's greedy ids."""
    import json

    prompts = [[1, 504, 3102, 282, 47970], [1, 9690, 28, 253], [1, 1780, 314, 260, 3575, 282]]
    (tmp_path / "ids.json").write_text(json.dumps(prompts))
    words = ["--prompts-file", str(tmp_path / "ids.json"), "--max-tokens", "24"]
    out = run(str(REPO / "examples/streams.py"), engine.address, *words)
    assert len(out["token_ids"]) == 3 and out["total_tokens"] == sum(len(t) for t in out["token_ids"])
    for ids, got in zip(prompts, out["token_ids"], strict=True):
        words = ["--prompt", "", *(f"--prompt-token-ids={i}" for i in ids), "--max-tokens", "24"]
        assert got == run("text-completion", engine.address, *words)["token_ids"]
