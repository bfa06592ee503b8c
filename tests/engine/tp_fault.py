"""Run by ``test_tensor_parallel.py`` in a process of its own (the process group is process-wide): rank 0 of a
real two-rank group on the tiny model runs one good forward, then one whose layer 1 MLP raises on rank 0 only
(after the ranks met in earlier all-reduces), and then tries a third. Prints one JSON line: the workers' exit
codes, what each call raised, how long rank 0 took to give up, and what ``on_broken`` heard."""

from __future__ import annotations

import json
import sys
import time

import torch

from pie_runtime.engine.tp_worker import TensorParallelBroken, start_tensor_parallel
from pie_runtime.models.context import Segment
from pie_runtime.models.llama import LlamaForCausalLM
from pie_runtime.store import load_model


def main(name: str) -> None:
    torch.set_num_threads(1)
    model = load_model(name, dtype=torch.float32, device="cpu", keep_quantized=False).model
    assert isinstance(model, LlamaForCausalLM)
    runner, _ = start_tensor_parallel(name, model, 2, 8, 16, "cpu", 1)
    heard: list[str] = []
    runner.group.on_broken = heard.append
    tokens = [1, 420, 77, 3141]

    def forward() -> str:
        try:
            runner.forward([Segment([0], 0, len(tokens))], tokens, list(range(len(tokens))))
            return "ok"
        except TensorParallelBroken as e:
            return f"TensorParallelBroken: {e}"

    first = forward()

    def fault(*_args, **_kwargs):
        raise RuntimeError("injected fault on rank 0")

    model.model.layers[1].mlp.forward = fault  # type: ignore[method-assign]
    t0 = time.monotonic()
    second = forward()
    gave_up_s = time.monotonic() - t0
    third = forward()
    exits = [p.exitcode for p in runner.group.procs]  # 1: it left by itself; -9: rank 0 had to kill it
    print(json.dumps({"exits": exits, "calls": [first, second, third], "gave_up_s": gave_up_s, "heard": heard}))
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
