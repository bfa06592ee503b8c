"""The parts of the benchmarks (pie_runtime/bench/): the report's ratios and table, the engine's pass-cost line,
peak RSS, the packaged GGUF llama.cpp runs on, and the transformers worker on the tiny model."""

from __future__ import annotations

import pytest
from rich.console import Console

from pie_runtime.bench.hf_worker import HfJob, measure
from pie_runtime.bench.llama_cpp_env import LlamaCppUnavailable, gguf_label, model_gguf
from pie_runtime.bench.pie_runs import parse_pass_costs
from pie_runtime.bench.report import Measured, Report, Row, print_report
from pie_runtime.bench.rss import peak_rss_mib
from pie_runtime.store import DEFAULT_MODEL
from tests.conftest import TINY


def row(runner: str, variant: str, rate: float, ids: list[int], costs: dict[int, float] | None = None) -> Row:
    m = Measured(decode_tokens_per_s=rate, prefill_tokens_per_s=500.0, prompt_tokens=518, token_ids=ids)
    return Row.of(runner, variant, m, costs)


def test_ratios_and_table():
    report = Report(model="m", threads=2, tokens=4, formats=["fp32", "int4"], prompt="p", note="shared CPU")
    report.rows = [
        row("pie", "fp32", 20.0, [1, 2, 3, 4], {1: 30.0, 4: 40.0, 8: 45.0, 16: 60.0}),
        row("pie", "int4", 100.0, [1, 2, 3, 5], {1: 10.0, 8: 30.0}),
        row("transformers", "fp32", 10.0, [1, 2, 3, 4]),
        Row.of(
            "llama.cpp",
            "Q4_1",
            Measured(
                decode_tokens_per_s=50.0,
                prompt_tokens=518,
                token_ids=[1, 2, 3, 4],
                pass_cost_ms={1: 8.0, 4: 10.0, 8: 12.0, 16: 20.0},
            ),
        ),
    ]
    report.speculation_prompt = "repetitive"
    report.speculation = [row("pie", "fp32 cacheback", 75.0, [7]), row("llama.cpp", "Q4_1 plain", 25.0, [7])]
    report.add_ratios()
    fp32, int4, hf, llama = report.rows
    assert (int4.vs_llama_cpp, int4.vs_transformers_fp32) == (2.0, 10.0)
    assert (fp32.vs_llama_cpp, hf.vs_transformers_fp32, llama.vs_llama_cpp) == (0.4, 1.0, 1.0)
    assert fp32.pass_cost_over_1(8) == 1.5 and int4.pass_cost_over_1(8) == 3.0 and hf.pass_cost_over_1(8) is None
    assert fp32.pass_cost_over_1(16) == 2.0 and int4.pass_cost_over_1(16) is None and llama.pass_cost_over_1(16) == 2.5
    assert (fp32.same_tokens_as_pie_fp32, int4.same_tokens_as_pie_fp32, hf.same_tokens_as_pie_fp32) == (
        None,
        False,
        True,
    )
    assert report.speculation[0].vs_llama_cpp == 3.0
    console = Console(record=True, width=220)
    print_report(report, console)
    text = console.export_text()
    assert (
        "pie int4" in text
        and "10.00x" in text
        and "30.0 / 40.0 / 45.0 / 60.0" in text
        and "8.0 / 10.0 / 12.0 / 20.0" in text
        and "shared CPU" in text
    )
    assert "speculation on the repetitive prompt" in text and "3.00x" in text
    assert Report.model_validate_json(report.model_dump_json()) == report  # the --json form reads back


def test_pass_cost_line():
    log = "x\nsmollm2-135m: pass cost by rows (ms) 1:36.0 2:37.1 4:40.2 8:42.5 16:49.0 32:61.3\ny\n"
    assert parse_pass_costs(log) == {1: 36.0, 2: 37.1, 4: 40.2, 8: 42.5, 16: 49.0, 32: 61.3}
    assert parse_pass_costs("no such line") == {}
    noted = "m: pass cost by rows (ms) 1:36.0 2:37.1 (reused, measured 2026-12-03 15:49; now 35.0)\n"
    assert parse_pass_costs(noted) == {1: 36.0, 2: 37.1}  # a note after the pairs is not a pair


def test_peak_rss():
    mine = peak_rss_mib()
    assert mine is not None and mine > 10  # this interpreter holds torch and pydantic
    assert peak_rss_mib(2**30) is None  # no such process


def test_llama_cpp_runs_the_gguf_a_model_was_imported_from():
    path = model_gguf(DEFAULT_MODEL)
    assert path.suffix == ".gguf" and gguf_label(path) == "Q4_1"  # the packaged file's own kind names its rows
    with pytest.raises(LlamaCppUnavailable, match="no GGUF file"):
        model_gguf(TINY)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_transformers_worker_on_the_tiny_model(pie_home, monkeypatch, dtype):
    import torch

    monkeypatch.setenv("PIE_HOME", str(pie_home))
    ids = [1, 504, 3102, 282, 47970, 14183, 28, 32047]
    m = measure(HfJob(model=TINY, dtype=dtype, threads=torch.get_num_threads(), prompt_ids=ids, tokens=6))
    assert m.prompt_tokens == len(ids) and 0 < len(m.token_ids) <= 6
    assert m.prefill_tokens_per_s and m.prefill_tokens_per_s > 0 and m.peak_rss_mib and m.peak_rss_mib > 0
    assert m.decode_tokens_per_s > 0 or len(m.token_ids) == 1


def test_llama_cpp_is_built_for_what_the_cpu_has():
    from pie_runtime.bench.llama_cpp_env import build_name, cmake_args

    plain = cmake_args({"avx2", "fma", "f16c"})
    assert "-DGGML_AVX512=OFF" in plain and build_name(plain) == "avx2"
    zen4 = cmake_args({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"})
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"} <= set(zen4)
    assert "-DGGML_AVX512=OFF" not in zen4 and build_name(zen4) == "avx2+avx512+avx512_vnni+avx512_bf16"
    assert "-DGGML_AVX512=ON" not in cmake_args({"avx2", "avx512f"})  # F alone, without BW and VL: not enough
