"""The parts of `pie bench decode --depth` and `--peers openvino` that run without a network or an engine: the
depth prompt's ids, the KV pool sized for them, and OpenVINO's "skipped: why" lines (the install and export
themselves need the package index: they run in `pie bench decode --peers openvino`, not here)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from pie_runtime.bench import openvino_env
from pie_runtime.bench.pie_runs import Job, kv_memory_args
from pie_runtime.bench.prompts import depth_corpus, depth_prompt_ids
from pie_runtime.bench.report import Report
from pie_runtime.cli.bench_decode import DecodeBench, DecodeOptions
from pie_runtime.launcher import LaunchError
from pie_runtime.store import DEFAULT_MODEL, ModelStore


def test_depth_prompt_has_exactly_n_ids_with_the_models_bos(tmp_path):
    tok = ModelStore().path(DEFAULT_MODEL) / "tokenizer.json"
    corpus = tmp_path / "c.txt"
    corpus.write_text(
        "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 50
    )
    ids = depth_prompt_ids(tok, corpus, 300, bos=7)
    assert len(ids) == 300 and ids[0] == 7 and 7 not in ids[1:4]
    assert depth_prompt_ids(tok, corpus, 300, bos=None)[:299] == ids[1:]  # the same text after the BOS
    with pytest.raises(LaunchError, match="fewer than"):
        depth_prompt_ids(tok, corpus, 100_000, None)
    with pytest.raises(LaunchError, match="no corpus file"):
        depth_corpus(tmp_path / "absent.txt")


def test_a_job_hands_its_ids_as_they_are():
    job = Job("plain", "text-completion", "austen", ids=list(range(600)))
    words = job.prompt_words()
    assert words[:4] == ["--prompt", "", "--prompt-token-ids=0", "--prompt-token-ids=1"] and len(words) == 602
    assert job.warm_up().ids == list(range(512))  # the warm-up reads the prefill path, not the whole depth
    plain = Job("plain", "text-completion", "hello")
    assert plain.prompt_words() == ["--prompt", "hello"] and plain.warm_up().prompt == "hello"


def test_kv_pool_is_sized_for_the_depth():
    cfg = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)
    assert kv_memory_args(cfg, 1000, []) == ["--kv-memory", "1024"]  # small: the engine's default stays
    big = int(kv_memory_args(cfg, 32_000, [])[1])
    assert big * (1 << 20) >= 30 * 3 * 64 * 2 * 4 * 32_000  # every row of every layer in float32 fits
    assert kv_memory_args(cfg, 32_000, ["--kv-pages", "10"]) == []  # the user's own size wins
    assert kv_memory_args(SimpleNamespace(), 32_000, []) == []


def test_openvino_failures_are_one_line_skips(monkeypatch):
    def no_install(progress=print):
        raise openvino_env.OpenVinoUnavailable("the install failed (no index; log /x/install.log)")

    monkeypatch.setattr(openvino_env, "ensure_openvino", no_install)
    lines: list[str] = []
    report = Report(model="m", threads=2, tokens=4, formats=["int4"], prompt="p")
    DecodeBench(DecodeOptions(peers=["openvino"]), report, {}, lines.append).openvino([1, 2, 3], [0])
    assert [(s.runner, s.variant) for s in report.skipped] == [("openvino", "int4 g32")] and report.rows == []
    assert lines == ["openvino int4 g32 skipped: the install failed (no index; log /x/install.log)"]


def test_a_failing_step_names_its_log_line(tmp_path):
    log = tmp_path / "install.log"
    log.write_text("")
    cmd = [sys.executable, "-c", "import sys; print('no matching distribution'); sys.exit(3)"]
    with pytest.raises(openvino_env.OpenVinoUnavailable, match=r"the install failed \(no matching distribution; log"):
        openvino_env._run(cmd, log, "the install")


def test_export_refuses_a_model_it_cannot_write(tmp_path, monkeypatch):
    monkeypatch.setenv("PIE_HOME", str(tmp_path))
    with pytest.raises(openvino_env.OpenVinoUnavailable, match="no-such-model"):
        openvino_env.hf_folder("no-such-model", tmp_path / "hf")
