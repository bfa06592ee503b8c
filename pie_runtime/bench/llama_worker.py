"""llama.cpp's side of `pie bench decode`, run as a script by the Python of the bench's llama-cpp-python
install (``llama_cpp_env``), never imported by pie_runtime:

    <llama venv>/bin/python llama_worker.py '{"gguf": ..., "threads": 2, "prompt_ids": [...], "tokens": 128,
                                              "eos_ids": [2], "lookup": 0}'

It has only the standard library and llama_cpp, so it reads and writes plain JSON; the bench validates the
line it prints (``report.Measured``). The decode is ``Llama.generate`` greedy (temp 0) on the given token ids,
from an empty KV cache (``reset()``; otherwise llama-cpp-python would reuse the warm-up's prompt), stopped at
an EOS id or the token count; with ``lookup`` > 0 its drafts come from ``LlamaPromptLookupDecoding``.
prefill = start → first token; decode rate = (n - 1) kept tokens over first → last token (an EOS's step
counts in the time, not the tokens), as for the others. ``swa_full`` (when given) picks the cache of sliding
layers: False is llama-bench's window-sized one (`pie bench decode --depth`).

With ``pass_rows`` (e.g. [1, 4, 8, 16]) it then times one sequence's pass of that many tokens after
``pass_context`` cached tokens, logits for every row, as the engine's pass-cost curve does (the median of
``pass_repeats``, the widths taken round-robin so that a slow spell of the machine spreads over all of them).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def peak_rss_mib() -> float | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def timed_generate(llm, prompt_ids: list[int], tokens: int, eos: set[int]) -> tuple[list[int], list[float], float]:
    """(ids, arrival time of each, start time), greedy, from an empty cache."""
    llm.reset()
    ids: list[int] = []
    times: list[float] = []
    t0 = time.perf_counter()
    for tok in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        times.append(time.perf_counter())
        if tok in eos:
            break
        ids.append(int(tok))
        if len(ids) >= tokens:
            break
    return ids, times, t0


def pass_costs(llm, rows: list[int], context: int, repeats: int) -> dict[int, float]:
    """Median ms of a pass of each of ``rows`` tokens after ``context`` cached ones, logits on every row."""
    llm._logits_all = True  # every row's logits, as a verify window reads them (the scores buffer has room)
    llm.reset()
    llm.eval([(i * 7919) % llm.n_vocab() for i in range(context)])
    times: dict[int, list[float]] = {w: [] for w in rows}
    for rep in range(repeats + 1):  # the first round warms each width up
        for w in rows:
            llm.n_tokens = context  # eval drops the cache past this and writes the window there
            t0 = time.perf_counter()
            llm.eval([(i * 31 + 1) % llm.n_vocab() for i in range(w)])
            if rep:
                times[w].append((time.perf_counter() - t0) * 1e3)
    return {w: round(statistics.median(v), 3) for w, v in times.items()}


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    # only in the bench's llama-cpp-python venv, never in the project's
    from llama_cpp import Llama  # pyright: ignore[reportMissingImports]
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # pyright: ignore[reportMissingImports]

    lookup = int(job.get("lookup", 0))
    # swa_full=False: a window-sized cache for sliding layers (llama-bench's); llama-cpp-python's default is full
    swa = {"swa_full": bool(job["swa_full"])} if job.get("swa_full") is not None else {}
    llm = Llama(
        model_path=job["gguf"],
        n_ctx=max(2048, len(job["prompt_ids"]) + job["tokens"] + 64, job.get("pass_context", 0) + 64),
        n_batch=1024,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup > 0 else None,
        verbose=False,
        **swa,
    )
    eos = set(job.get("eos_ids") or [llm.token_eos()])
    prompt = job["prompt_ids"]
    timed_generate(llm, prompt if len(prompt) <= 1024 else prompt[:512], 4, eos)  # warm-up, not a whole depth
    ids, times, t0 = timed_generate(llm, job["prompt_ids"], job["tokens"], eos)
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    out = {
        "decode_tokens_per_s": (len(ids) - 1) / decode_s if decode_s > 0 and ids else 0.0,
        "prefill_tokens_per_s": len(job["prompt_ids"]) / (times[0] - t0) if times else None,
        "prompt_tokens": len(job["prompt_ids"]),
        "token_ids": ids,
        "peak_rss_mib": peak_rss_mib(),  # before the pass costs: the decode's own peak
    }
    if job.get("pass_rows"):
        out["pass_cost_ms"] = pass_costs(
            llm, job["pass_rows"], job.get("pass_context", 128), job.get("pass_repeats", 5)
        )
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
