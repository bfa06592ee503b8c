"""`pie bench decode`: option parsing, and one tiny end-to-end run (pie fp32; llama.cpp skipped: the tiny model
has no GGUF). Its parts (report, workers) are tested in tests/bench/."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from pie_runtime.bench.report import Report
from pie_runtime.cli.bench_decode import DecodeOptions
from pie_runtime.cli.main import build_parser, main
from pie_runtime.store import DEFAULT_MODEL
from tests.conftest import TINY


def options(*words: str) -> DecodeOptions:
    return DecodeOptions.from_args(build_parser().parse_args(["bench", "decode", *words]))


def test_options_split_comma_lists_and_keep_defaults():
    o = options("--formats", "fp32, int4", "--peers", "none", "--tokens", "8", "--threads", "1")
    assert o.formats == ["fp32", "int4"] and o.peers == [] and o.tokens == 8 and o.threads == 1
    d = options()
    assert d.formats == ["fp32", "bf16", "int8", "int4"] and d.peers == ["transformers", "llama.cpp"]
    assert d.model == DEFAULT_MODEL and d.threads >= 1 and not d.speculation and not d.json_output


@pytest.mark.parametrize("words", [["--formats", "fp16"], ["--peers", "vllm"], ["--tokens", "1"], ["--formats", ""]])
def test_options_refuse_what_cannot_run(words):
    with pytest.raises(ValidationError):
        options(*words)


def test_cli_reports_a_bad_option_without_running(capsys):
    assert main(["bench", "decode", "--formats", "fp32,fp8"]) == 2
    assert "--formats" in capsys.readouterr().err


def test_tiny_end_to_end(pie_home):
    cmd = [sys.executable, "-m", "pie_runtime.cli.main", "bench", "decode", "--model", TINY, "--formats", "fp32"]
    cmd += ["--tokens", "8", "--threads", "1", "--peers", "llama.cpp", "--json"]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PIE_HOME": str(pie_home)}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = Report.model_validate(json.loads(out.stdout.strip().splitlines()[-1]))
    assert report.threads == 1 and report.formats == ["fp32"]
    rows = {r.label: r for r in report.rows}
    assert set(rows) == {"pie fp32"}
    pie = rows["pie fp32"]
    assert pie.decode_tokens_per_s > 0 and pie.prefill_tokens_per_s and pie.prompt_tokens > 400
    assert pie.peak_rss_mib and pie.peak_rss_mib > 0 and {1, 8, 16} <= set(pie.pass_cost_ms)
    assert 0 < pie.generated_tokens <= 8 and pie.vs_llama_cpp is None and pie.vs_transformers_fp32 is None
    assert report.read_gb_s and report.read_gb_s > 0  # the machine's read bandwidth, timed in the run
    assert pie.token_mb and pie.token_mb > 0 and pie.bandwidth_share and pie.bandwidth_share > 0
    assert [(s.runner, s.variant) for s in report.skipped] == [("llama.cpp", "GGUF")]
    assert "llama.cpp GGUF skipped: no GGUF file" in out.stderr  # the tiny model came from a Hugging Face folder


def test_depth_and_openvino_options():
    o = options("--depth", "8000", "--peers", "llama.cpp,openvino", "--depth-corpus", "/x/austen.txt")
    assert o.depth == 8000 and o.peers == ["llama.cpp", "openvino"] and str(o.depth_corpus) == "/x/austen.txt"
    assert options().depth is None and options().depth_corpus is None  # no --depth: the 512-token prompt as before
    with pytest.raises(ValidationError):
        options("--depth", "1")


def test_cli_refuses_a_depth_past_the_context(pie_home, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PIE_HOME", str(pie_home))
    corpus = tmp_path / "c.txt"
    corpus.write_text("word " * 100)
    words = ["bench", "decode", "--model", TINY, "--peers", "none", "--depth-corpus", str(corpus)]
    assert main([*words, "--depth", "100000"]) == 2
    assert "past tiny-smol's context" in capsys.readouterr().err


def test_depth_is_honoured_by_pie_and_llama_cpp(tmp_path):
    """A random-weight 2-layer GGUF with the default model's vocabulary (examples/make_gguf.py) at --depth 600:
    pie's row and llama.cpp's (where its env is built) read exactly 600 prompt ids, and the ratio between them is
    in the one report."""
    from examples.make_gguf import write
    from pie_runtime.bench.llama_cpp_env import _importable, venv_python
    from pie_runtime.store import ModelStore, import_model

    home, gguf = tmp_path / "home", tmp_path / "t.gguf"
    write(gguf, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seed=0)
    import_model(str(gguf), name="tiny-gguf", store=ModelStore(home / "models"), progress=False)
    corpus = tmp_path / "c.txt"
    corpus.write_text("It is a truth universally acknowledged. " * 200)
    cmd = [sys.executable, "-m", "pie_runtime.cli.main", "bench", "decode", "--model", "tiny-gguf", "--formats", "fp32"]
    cmd += ["--tokens", "4", "--threads", "1", "--peers", "llama.cpp", "--depth", "600", "--depth-corpus", str(corpus)]
    out = subprocess.run(
        [*cmd, "--json"], capture_output=True, text=True, timeout=600, env={**os.environ, "PIE_HOME": str(home)}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = Report.model_validate(json.loads(out.stdout.strip().splitlines()[-1]))
    assert report.prompt == "c.txt, 600 tokens"
    rows = {r.runner: r for r in report.rows}
    assert rows["pie"].prompt_tokens == 600 and 0 < rows["pie"].generated_tokens <= 4
    if not _importable(venv_python()):
        assert [s.runner for s in report.skipped] == ["llama.cpp"]
        pytest.skip("llama-cpp-python is not built here (`pie bench decode` builds it): pie's side checked")
    llama = rows["llama.cpp"]
    assert llama.prompt_tokens == 600 and llama.variant.endswith("window SWA cache")
    assert rows["pie"].vs_llama_cpp == round(rows["pie"].decode_tokens_per_s / llama.decode_tokens_per_s, 2)
