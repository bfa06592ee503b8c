"""OpenVINO GenAI's side of `pie bench decode --peers openvino` and examples/bench_streams_openvino.py, run as a
script by the Python of the bench's OpenVINO venv (``openvino_env``), never imported by pie_runtime:

    <openvino venv>/bin/python openvino_worker.py '{"model_dir": ..., "threads": 2, "prompt_ids": [...],
                                                    "tokens": 128, "eos_ids": [2]}'
    ... '{"model_dir": ..., "threads": 2, "streams": [[ids], [ids], ...], "tokens": 128, "eos_ids": [2]}'

Only the standard library, numpy and openvino_genai: it prints plain JSON on its last line. The first form is a
batch-1 greedy decode with ``LLMPipeline`` (``INFERENCE_NUM_THREADS``, prefix caching off as pie's engine runs
in the bench), timed by a streamer: prefill = start → first token, decode rate = (n - 1) kept tokens over first →
last token, a ``report.Measured``. The second runs every prompt at once through ``ContinuousBatchingPipeline``
(prefix caching off), greedy, and prints the total new tokens, the wall seconds (prefill included) and each
stream's ids. Both cut each stream before its first EOS, as the other runners count tokens.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def peak_rss_mib() -> float | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def until_eos(ids: list[int], eos: list[int]) -> list[int]:
    """``ids`` cut before the first EOS (as the other runners count them)."""
    return ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))]


def greedy_config(g, tokens: int, eos: list[int]):
    cfg = g.GenerationConfig()
    cfg.max_new_tokens = tokens
    cfg.do_sample = False
    if eos:
        cfg.stop_token_ids = set(eos)
    return cfg


def ids_tensor(ids: list[int]):
    import numpy as np
    import openvino as ov  # pyright: ignore[reportMissingImports]

    return ov.Tensor(np.array([ids], dtype=np.int64))


def decode(job: dict) -> dict:
    import openvino_genai as g  # pyright: ignore[reportMissingImports]

    class Clock(g.StreamerBase):
        """Notes when each new token arrives."""

        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def write(self, token):
            self.times.append(time.perf_counter())
            return g.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    sched = g.SchedulerConfig()
    sched.enable_prefix_caching = False  # else the warm-up's prompt is a cache hit and prefill is not computed
    pipe = g.LLMPipeline(job["model_dir"], "CPU", scheduler_config=sched, INFERENCE_NUM_THREADS=int(job["threads"]))
    prompt, eos = job["prompt_ids"], list(job.get("eos_ids") or [])
    warm = prompt if len(prompt) <= 1024 else prompt[:512]  # first-call costs, not a whole depth
    pipe.generate(ids_tensor(warm), greedy_config(g, 4, eos))
    clock = Clock()
    t0 = time.perf_counter()
    res = pipe.generate(ids_tensor(prompt), greedy_config(g, int(job["tokens"]), eos), clock)
    ids = until_eos([int(t) for t in res.tokens[0]], eos)
    times = clock.times
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    return {
        "decode_tokens_per_s": (len(ids) - 1) / decode_s if decode_s > 0 and ids else 0.0,
        "prefill_tokens_per_s": len(prompt) / (times[0] - t0) if times else None,
        "prompt_tokens": len(prompt),
        "token_ids": ids,
        "peak_rss_mib": peak_rss_mib(),
    }


def streams(job: dict) -> dict:
    import openvino_genai as g  # pyright: ignore[reportMissingImports]

    sched = g.SchedulerConfig()
    sched.max_num_seqs = max(len(job["streams"]), sched.max_num_seqs)
    sched.enable_prefix_caching = False  # every stream prefills its own prompt, as pie's do (--no-prefix-cache)
    pipe = g.ContinuousBatchingPipeline(job["model_dir"], sched, "CPU", {"INFERENCE_NUM_THREADS": int(job["threads"])})
    eos = list(job.get("eos_ids") or [])
    prompts = [ids_tensor(p) for p in job["streams"]]
    pipe.generate(prompts[:1], [greedy_config(g, 4, eos)])  # warm-up
    configs = [greedy_config(g, int(job["tokens"]), eos) for _ in prompts]
    t0 = time.perf_counter()
    results = pipe.generate(prompts, configs)
    seconds = time.perf_counter() - t0
    outs = [until_eos([int(t) for t in r.m_generation_ids[0]], eos) for r in results]
    total = sum(len(o) for o in outs)
    return {"token_ids": outs, "total_tokens": total, "seconds": seconds, "tokens_per_s": total / seconds}


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    out = streams(job) if job.get("streams") else decode(job)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
