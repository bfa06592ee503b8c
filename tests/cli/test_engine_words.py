"""What `pie serve`, `pie run` and `pie bench` hand the engine they start (``cli/serve.engine_words``,
``cli/run.engine_args``): every engine option they were given, so the engine runs as asked (``--kv-swa-full`` was
accepted and dropped: `pie serve --kv-swa-full` served page groups)."""

from __future__ import annotations

import argparse

from pie_runtime.cli.engine import add_engine_options
from pie_runtime.cli.run import engine_args
from pie_runtime.cli.serve import engine_words

ASKED = [
    "--device", "cuda", "--weights", "int8", "--page-size", "8", "--max-batch-tokens", "128", "--kv-memory", "96",
    "--threads", "3", "--compile", "--no-prefix-cache", "--kv-swa-full", "--state-slots", "5",
    "--recurrent-fold", "replay", "--per-row-states", "3", "--pass-cost-rows", "4", "--pass-cost-cache", "off",
    "--program-memory", "32", "--max-programs", "7", "--no-prepack", "--simulate-step-ms", "250",
    "--thread-wait", "short",
]  # fmt: skip


def parse(words: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_options(p)
    return p.parse_args(words)


def test_every_engine_option_reaches_the_engine():
    given = parse(ASKED)
    defaults = vars(parse([]))
    assert all(vars(given)[k] != v for k, v in defaults.items() if k not in ("dtype", "kv_pages", "tensor_parallel"))
    assert vars(parse(engine_words(given))) == vars(given)  # pie serve's engine
    assert vars(parse(engine_args(given))) == {**vars(given), "simulate_step_ms": 0.0}  # pie run's, pie bench's
    tp = parse(["--tensor-parallel", "2", "--weights", "fp32", "--kv-pages", "300"])
    assert vars(parse(engine_words(tp))) == vars(tp)
