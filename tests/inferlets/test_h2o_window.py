"""h2o on a sliding-window model (Gemma 3: page groups of window 512 beside global ones): a run whose evictions
could bring rows the sliding layers let go of back into their window is refused before it starts, with the
options that make it exact; runs that stay below the window, keep the window's rows recent, or never evict, and
models without a window, are not. (Before, the engine refused the first such eviction mid-run, `unsupported`.)"""

from __future__ import annotations

import importlib.util

from tests.inferlets.conftest import INFERLETS

GEMMA = [None, 512, 512, 512, 512, 512]  # gemma3-270m's page groups
CHUNK, PREFILL = 16, 64


def window_conflict():
    spec = importlib.util.spec_from_file_location("inferlet_h2o", INFERLETS / "h2o.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.window_conflict


def test_a_budget_past_the_window_with_few_recent_rows_is_refused_naming_the_fixes():
    why = window_conflict()(GEMMA, 900, 600, 300, CHUNK, PREFILL)
    assert why is not None and "512" in why and "--recent 511" in why and "at most 433" in why


def test_runs_the_engine_allows_are_not_refused():
    conflict = window_conflict()
    assert conflict(GEMMA, 900, 256, 128, CHUNK, PREFILL) is None  # the default budget: nothing is let go
    assert conflict(GEMMA, 900, 433, 100, CHUNK, PREFILL) is None  # the largest budget below the window
    assert conflict(GEMMA, 900, 600, 511, CHUNK, PREFILL) is None  # the window's rows are all recent ones
    assert conflict(GEMMA, 600, 600, 300, CHUNK, PREFILL) is None  # never evicts
    assert conflict([None], 900, 600, 300, CHUNK, PREFILL) is None  # no window (or --kv-swa-full)
    assert conflict(GEMMA, 900, 434, 100, CHUNK, PREFILL) is not None
