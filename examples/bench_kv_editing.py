"""KV editing bench: what evicting KV rows costs in quality and gains in speed, on the default model and corpus
text (issue 40's aims).

Perplexity of ``--tokens`` tokens of corpus text, teacher-forced: the text is fed ``--chunk`` tokens a fire,
each fire reading the log-probability of every next token (a Logits readout on its rows), and the policy evicts
between fires as it would while generating, so every prediction sees only the rows the policy kept. Policies, all
holding ``--budget`` rows (default a quarter of the text) plus at most a page and a chunk before each eviction:

    full           no eviction (the reference)
    window         the last ``budget`` rows (a plain sliding window)
    sinks+window   ``--sinks`` first rows plus the last ``budget - sinks`` (StreamingLLM: Xiao et al. 2023,
                   "Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453;
                   inferlets/streaming-llm.py's rule)
    h2o            the ``--recent`` last rows plus the heaviest hitters by accumulated attention mass (Zhang et
                   al. 2023, arXiv:2306.14048; inferlets/h2o.py's rule, reading the AttentionScores readout)

Then, from where the text ends, ``--decode`` greedy tokens one fire each with the same policy: the decode rate
at long context with the full KV against the policy's smaller one. Last, the attention readout's own cost: a 1-row
pass over ``--cost-rows`` KV rows with and without it (alternated, medians; the row is not folded, so the
context stays the same).

    .venv/bin/python examples/bench_kv_editing.py [--tokens 4096] [--budget N] [--weights int4] [--threads 2]
        [--quick]

Kept rows keep their positions (the engine's rule), so positions run to the text's length as in full attention.
Prints a markdown table (docs/performance.md, "KV editing"); ``--json`` prints the figures as JSON instead.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import inferlet
from pie_runtime.distill import find_corpus
from pie_runtime.launcher import EmbeddedEngine
from pie_runtime.store import DEFAULT_MODEL

INFERLETS = Path(__file__).resolve().parents[1] / "inferlets"
ENGINE_PID = [0]  # the engine process, whose CPU time the figures read (a loaded machine's wall time is noise)


def engine_cpu_s() -> float:
    """User + system CPU seconds the engine process has used (its threads included), from /proc."""
    fields = Path(f"/proc/{ENGINE_PID[0]}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def inferlet_module(name: str):
    """A shipped inferlet's module (its policy classes), loaded from inferlets/."""
    spec = importlib.util.spec_from_file_location(f"inferlet_{name.replace('-', '_')}", INFERLETS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Trimmed:
    """A policy that evicts after each fire by its ``trim(ws)`` alone (the sliding windows), or never (None)."""

    def __init__(self, policy=None):
        self.policy = policy

    async def fire(self, ws: inferlet.WorkingSet, window: list[int], fp: inferlet.ForwardPass) -> inferlet.PassResult:
        res = await fp.submit()
        if self.policy is not None:
            await self.policy.trim(ws)
        return res


@dataclass
class Row:
    policy: str
    budget: int | None
    perplexity: float
    pages_max: int
    pages_mean: float
    feed_tok_s: float
    decode_tok_s: float
    decode_cpu_ms: float  # engine CPU time a decode token


def next_token_nll(logits: np.ndarray, targets: list[int]) -> float:
    """Sum over rows of -log softmax(logits)[target]."""
    x = logits[: len(targets)].astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(x - m).sum(axis=1))) if len(targets) else np.zeros(0)
    return float((lse - x[np.arange(len(targets)), targets]).sum())


async def teacher_forced(
    model, ids: list[int], policy, chunk: int, decode: int
) -> tuple[float, list[int], float, tuple[float, float]]:
    """(perplexity, pages held after each fire, tokens/s) of ``ids`` fed ``chunk`` a fire under ``policy``, and
    the decode rate of ``decode`` greedy tokens after them."""
    ws = model.working_set()
    nll, pages = 0.0, []
    t0 = time.perf_counter()
    for i in range(0, len(ids) - 1, chunk):
        window = ids[i : i + chunk]
        targets = ids[i + 1 : i + 1 + len(window)]
        fp = inferlet.ForwardPass(ws).embed(window).readout(range(len(targets)), inferlet.Logits())
        res = await policy.fire(ws, window, fp)
        nll += next_token_nll(res.readouts[0].logits, targets)
        pages.append(ws.pages)
    rate = (len(ids) - 1) / (time.perf_counter() - t0)
    decode_tok_s = await decode_rate(ws, ids[-1], policy, decode)
    await ws.release()
    return float(np.exp(nll / (len(ids) - 1))), pages, rate, decode_tok_s


async def decode_rate(ws: inferlet.WorkingSet, token: int, policy, steps: int) -> tuple[float, float]:
    """Greedy tokens a second over ``steps`` steps from ``token`` on ``ws`` (the policy still evicting), and the
    engine's CPU ms a token."""
    t0, c0 = time.perf_counter(), engine_cpu_s()
    for _ in range(steps):
        fp = inferlet.ForwardPass(ws).embed([token]).readout([0], inferlet.Argmax())
        res = await policy.fire(ws, [token], fp)
        token = int(res.readouts[0].tokens[0])
    if not steps:
        return 0.0, 0.0
    return steps / (time.perf_counter() - t0), (engine_cpu_s() - c0) * 1e3 / steps


async def readout_cost(model, ids: list[int], rows: int, repeats: int) -> dict:
    """Median ms of a 1-row pass over ``rows`` KV rows with and without the attention readout."""
    ws = model.working_set()
    for i in range(0, rows, 256):
        await inferlet.ForwardPass(ws).embed(ids[i : min(i + 256, rows)]).submit()
    times: dict[str, list[float]] = {"without": [], "with": []}
    cpu = dict.fromkeys(times, 0.0)
    for _ in range(repeats):
        for label in times:
            fp = inferlet.ForwardPass(ws).embed([ids[rows]]).readout([0], inferlet.Argmax()).fold(0)
            if label == "with":
                fp.readout([0], inferlet.AttentionScores())
            t0, c0 = time.perf_counter(), engine_cpu_s()
            await fp.submit()
            times[label].append((time.perf_counter() - t0) * 1e3)
            cpu[label] += engine_cpu_s() - c0
    await ws.release()
    ms = {k: round(statistics.median(v), 2) for k, v in times.items()}
    cpu_ms = {k: round(v * 1e3 / repeats, 2) for k, v in cpu.items()}
    return {
        "kv_rows": rows,
        "ms_without": ms["without"],
        "ms_with": ms["with"],
        "cpu_ms_without": cpu_ms["without"],
        "cpu_ms_with": cpu_ms["with"],
    }


def policies(budget: int, sinks: int, recent: int, page: int) -> dict[str, object]:
    sl, h2o = inferlet_module("streaming-llm"), inferlet_module("h2o")
    return {
        "full": Trimmed(),
        "window": Trimmed(sl.SinkWindow(0, budget, page)),
        "sinks+window": Trimmed(sl.SinkWindow(sinks, budget - sinks, page)),
        "h2o": h2o.HeavyHitters(budget, recent, page),
    }


async def bench(address: str, a: argparse.Namespace) -> dict:
    session = await inferlet.connect(address)
    try:
        model = inferlet.model()
        text = find_corpus(a.corpus)
        if text is None:
            raise SystemExit(f"no corpus file {a.corpus} (looked in ../shared/corpus and $PIE_CORPUS_DIR)")
        ids = model.tokenizer.encode(text.read_text()[a.offset : a.offset + 12 * a.tokens])[: a.tokens]
        budget = a.budget or len(ids) // 4
        rows = []
        for name, policy in policies(budget, a.sinks, a.recent or budget // 2, model.page_size).items():
            ppl, pages, rate, (decode, cpu_ms) = await teacher_forced(model, ids, policy, a.chunk, a.decode)
            kept = None if name == "full" else budget
            mean = round(float(np.mean(pages)), 1)
            rows.append(
                Row(name, kept, round(ppl, 3), max(pages), mean, round(rate, 1), round(decode, 1), round(cpu_ms, 2))
            )
        cost = await readout_cost(model, ids, min(a.cost_rows, len(ids) - 1), a.cost_repeats)
        figures = [asdict(r) for r in rows]
        return {"tokens": len(ids), "budget": budget, "chunk": a.chunk, "rows": figures, "readout_cost": cost}
    finally:
        session.client.close()


def table(result: dict) -> str:
    full = result["rows"][0]["perplexity"]
    lines = [
        "| policy | rows kept | perplexity | vs full | pages max | pages mean | feed tok/s | decode tok/s "
        "| decode engine CPU ms/token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        kept = "all" if r["budget"] is None else r["budget"]
        lines.append(
            f"| {r['policy']} | {kept} | {r['perplexity']:.3f} | {r['perplexity'] / full:.3f} | {r['pages_max']} | "
            f"{r['pages_mean']} | {r['feed_tok_s']} | {r['decode_tok_s']} | {r['decode_cpu_ms']} |"
        )
    c = result["readout_cost"]
    lines.append(
        f"\nattention readout, a 1-row pass over {c['kv_rows']} KV rows: median {c['ms_without']} ms without, "
        f"{c['ms_with']} ms with (wall); engine CPU {c['cpu_ms_without']} ms without, {c['cpu_ms_with']} ms with"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--budget", type=int, default=None, help="rows every eviction policy keeps (default: tokens / 4)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--recent", type=int, default=None, help="h2o's recent rows (default: half the budget)")
    p.add_argument("--chunk", type=int, default=16, help="text tokens a fire")
    p.add_argument("--decode", type=int, default=64, help="greedy tokens after the text, for the decode rate")
    p.add_argument("--cost-rows", type=int, default=1000)
    p.add_argument("--cost-repeats", type=int, default=30)
    p.add_argument("--weights", default="int4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--corpus", default="austen.txt")
    p.add_argument("--offset", type=int, default=20000, help="character offset into the corpus file")
    p.add_argument("--quick", action="store_true", help="512 tokens, 16 decode steps, 5 cost repeats")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.decode, a.cost_repeats, a.cost_rows = 512, 16, 5, min(a.cost_rows, 500)
    pages = max(1024, 2 * (a.tokens + a.decode) // 16 + 64)
    args = ["--weights", a.weights, "--threads", str(a.threads), "--kv-pages", str(pages), "--pass-cost-rows", "0"]
    engine = EmbeddedEngine([DEFAULT_MODEL], args)
    ENGINE_PID[0] = engine.proc.pid
    try:
        result = asyncio.run(bench(engine.address, a))
    finally:
        engine.stop()
    result.update(weights=a.weights, threads=a.threads, corpus=a.corpus)
    print(json.dumps(result, indent=1) if a.json else table(result))


if __name__ == "__main__":
    sys.exit(main())
