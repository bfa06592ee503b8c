"""Pass costs measured at engine start: published in hello for each model, one per window width, and
skipped when the KV pool cannot hold the measuring sequence."""

from __future__ import annotations

import torch

from pie_runtime.engine.pass_costs import measure_mtp_step_ms, measure_pass_costs, measured_widths
from pie_runtime.engine.runner import ModelRunner
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.llama import LlamaForCausalLM
from tests.models.tiny_models import tiny_llama_config


def tiny_runner(pages: int) -> ModelRunner:
    cfg = tiny_llama_config(max_positions=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    return ModelRunner(model, KVCache(cfg, pages, 16, torch.float32), torch.device("cpu"))


async def test_hello_carries_one_cost_per_width(tiny):
    costs = tiny.pass_cost_ms
    assert len(costs) == 32 and all(c > 0 for c in costs)
    assert tiny.mtp_step_ms == 0.0  # no MTP head on the tiny model


def test_measured_widths_cover_small_windows_and_the_maximum():
    assert measured_widths(40) == [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 40]
    assert measured_widths(3) == [1, 2, 3]


def test_costs_interpolate_between_measured_widths():
    costs = measure_pass_costs(tiny_runner(64), 64, 12, context=32, repeats=1)
    assert len(costs) == 12 and all(c > 0 for c in costs)
    lo, hi = sorted((costs[7], costs[11]))  # widths 8 and 12 were measured, 9..11 interpolated
    assert all(lo <= c <= hi for c in costs[8:11])


def test_a_pool_too_small_for_the_window_measures_nothing():
    runner = tiny_runner(1)
    assert measure_pass_costs(runner, 1, 16) == []
    assert measure_mtp_step_ms(runner) == 0.0
