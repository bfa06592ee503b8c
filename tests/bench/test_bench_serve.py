"""`pie bench serve`'s pieces: llama-server's build refused in one line when it cannot be built, the requests'
prompts (each its own, of the stated length), the process-tree RSS, and a ``--quick`` run against a real
`pie serve` with the llama-server side skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pie_runtime.bench import llama_server_env
from pie_runtime.bench.llama_cpp_env import LlamaCppUnavailable
from pie_runtime.bench.rss import TreePeak, tree_pids
from pie_runtime.bench.serve_load import Sample, chat_prompts, row_of
from tests.conftest import REPO
from tests.sdk.test_stream_decoder import tok  # noqa: F401 - the real tokenizer fixture


def test_no_cmake_is_one_line_saying_so(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_server_env.shutil, "which", lambda name: None)
    with pytest.raises(LlamaCppUnavailable, match=r"^cmake is not installed \(llama-server is built from source\)$"):
        llama_server_env.ensure_llama_server(root=tmp_path)


def test_a_failed_build_step_names_the_step_its_last_line_and_the_log(tmp_path):
    log = tmp_path / "log"
    cmd = [sys.executable, "-c", "import sys; print('first'); print('CMake Error: no compiler'); sys.exit(1)"]
    with pytest.raises(LlamaCppUnavailable) as e:
        llama_server_env._run(cmd, log, "configuring llama-server")
    assert str(e.value) == f"configuring llama-server failed (CMake Error: no compiler; log {log})"
    assert "\n" not in str(e.value) and "first" in log.read_text()


def test_a_built_binary_is_used_without_building(tmp_path, monkeypatch):
    binary = llama_server_env.server_binary(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    monkeypatch.setattr(llama_server_env.shutil, "which", lambda name: None)  # would refuse if it built
    assert llama_server_env.ensure_llama_server(root=tmp_path) == binary


def test_a_second_bench_waits_for_the_build_in_progress_and_says_so(tmp_path, monkeypatch):
    import fcntl
    import threading

    monkeypatch.setattr(llama_server_env.shutil, "which", lambda name: "/usr/bin/cmake")
    work = llama_server_env.server_dir(tmp_path)
    work.mkdir(parents=True)
    said: list[str] = []
    got: list[object] = []
    with open(work / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the build in progress
        waiter = threading.Thread(
            target=lambda: got.append(llama_server_env.ensure_llama_server(said.append, tmp_path))
        )
        waiter.start()
        for _ in range(200):
            if said:
                break
            time.sleep(0.05)
        assert said and said[0].startswith("waiting for the llama-server build in progress")
        binary = llama_server_env.server_binary(tmp_path)
        binary.parent.mkdir(parents=True)
        binary.write_text("")  # what the other build leaves
    waiter.join(30)
    assert got == [binary] and len(said) == 1  # it did not build again


def test_every_request_has_its_own_prompt_of_the_stated_length(tok):  # noqa: F811
    first = chat_prompts(tok, "One two three four five six seven.", 4, 24)
    later = chat_prompts(tok, "One two three four five six seven.", 4, 24, first=4)
    prompts = first + later
    assert len(set(prompts)) == 8 and all(p.startswith(f"Request {i}: ") for i, p in enumerate(prompts))
    assert all(abs(len(tok.encode(p)) - 24) <= 2 for p in prompts)  # decoded and re-encoded: a merge may differ


def test_rows_count_tokens_requests_and_failures():
    samples = [
        Sample(ttft=0.1, gaps=[0.02, 0.04], tokens=3, decode_s=0.06),
        Sample(ttft=0.3, gaps=[0.03], tokens=2, decode_s=0.03),
        Sample(error="HTTP 503"),
    ]
    row = row_of("x", samples, 2.0)
    assert (row.requests, row.tokens, row.tok_s, row.req_s, row.errors, row.error) == (3, 5, 2.5, 1.0, 1, "HTTP 503")
    assert (row.ttft_p99_ms, row.itl_p99_ms) == (300.0, 40.0)
    assert row.decode_tok_s == 33.3  # each request: its tokens after the first over first-to-last chunk


def test_the_tree_rss_counts_children():
    touch = "import time; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", touch])
    try:
        time.sleep(1.5)
        assert child.pid in tree_pids(os.getpid())
        peak = TreePeak(os.getpid()).start()
        assert peak.stop() >= 200  # the child's 200 MiB, touched page by page
    finally:
        child.kill()
        child.wait()


@pytest.mark.e2e
def test_quick_bench_against_a_real_pie_serve_with_llama_server_skipped(pie_home, tmp_path):
    blocked = tmp_path / "not-a-folder"  # the build cache cannot be made: the llama-server side is skipped
    blocked.write_text("")
    env = {**os.environ, "PIE_HOME": str(pie_home), "PIE_LLAMA_CPP_DIR": str(blocked)}
    cmd = [sys.executable, "-m", "pie_runtime.cli.main", "bench", "serve", "--quick", "--json"]
    cmd += ["--against", "llama-server", "--no-compile", "--kv-pages", "256", "--pass-cost-rows", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    skipped = [line for line in done.stderr.splitlines() if line.startswith("llama-server skipped: ")]
    assert len(skipped) == 1 and "cannot make the build folder" in skipped[0], done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["server"], r["concurrency"]) for r in rows] == [("pie serve", 1), ("pie serve", 2), ("pie run x 1", 1)]
    assert all(r["errors"] == 0 and r["tokens"] == 8 * r["concurrency"] for r in rows), rows
    assert all(r["peak_rss_mib"] > 100 for r in rows)
