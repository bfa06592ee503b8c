"""Scale-out measured on few cores: engine replicas behind the router, with *sleep engines* (the hidden
``--simulate-step-ms``: every engine step also sleeps, as if its forward ran on a device of its own, so two
engines on two busy cores scale as two devices would) on the tiny random model.

- **Scaling**: tokens/s of 16 concurrent greedy runs (64 tokens each) on 1 engine and on 2. Each engine
  takes ``--max-batch-tokens`` rows a step (a device that fits that batch), so 16 runs saturate one engine.
- **Prefix affinity**: requests that share system prompts (8 by default, ~100 tokens each, 4 users each;
  the first request of each prompt first, the rest shuffled, 8 at a time). The hit rate is the engines' own
  prefix cache (``stats``: cached prompt tokens / prompt tokens), for the cache-aware router, round robin,
  and one engine.

    python examples/bench_cluster.py [--step-ms 50] [--max-batch-tokens 8] [--systems 8] [--users 4] [--no-affinity]

The sleep hides the forward, not the hosts' and the engine loop's own CPU work: on a machine whose cores are
busy with other work, that work, not the sleep, can set the pace (raise --step-ms there).

Needs Ray (``pip install 'pie-runtime[ray]'``) and transformers (to write the tiny model).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inferlet.client import Client  # noqa: E402
from pie_runtime.cluster.backend import ClusterBackend  # noqa: E402
from pie_runtime.cluster.router import RouterConfig  # noqa: E402
from pie_runtime.protocol.messages import PROTOCOL_VERSION  # noqa: E402
from pie_runtime.serve.backend import EngineSpec  # noqa: E402
from pie_runtime.shipped import ensure_default_model  # noqa: E402
from pie_runtime.store import ModelStore  # noqa: E402
from tests.conftest import TINY, write_tiny_smol  # noqa: E402

NAMES = ["Ada", "Brook", "Cyrus", "Dmitri", "Elif", "Farah", "Goran", "Hana"]


@dataclass
class Row:
    setup: str
    tokens_per_s: float | None
    hit_rate: float
    placements: str


def tiny_home() -> Path:
    """A store holding the tiny model (random weights, the default model's tokenizer)."""
    home = Path(tempfile.mkdtemp(prefix="pie-bench-cluster-"))
    tokenizer = ModelStore().path(ensure_default_model().name) / "tokenizer.json"
    write_tiny_smol(home / "ckpt", tokenizer)
    env = {**os.environ, "PIE_HOME": str(home)}
    pie = [sys.executable, "-m", "pie_runtime.cli.main"]
    words = ["model", "import", str(home / "ckpt"), "--name", TINY]
    subprocess.run([*pie, *words], check=True, env=env, capture_output=True)
    return home


def system(i: int) -> str:
    return (
        f"{NAMES[i % len(NAMES)]} {i} speaking. You are a careful assistant for a library in a small town. Answer "
        "questions about opening hours, loans, late fees, the reading club and the children's corner, politely "
        "and briefly, and never invent a rule that the library does not have. Say when you do not know."
    )


async def engine_prefix_stats(backend: ClusterBackend) -> tuple[int, int]:
    """(prompt tokens asked of the prefix caches, tokens found there), summed over the live engines."""
    queried = hit = 0
    assert backend.cluster is not None
    for slot in backend.cluster.slots.values():
        if slot.info is None:
            continue
        c = Client(slot.info.address)
        try:
            await c.request("hello", version=PROTOCOL_VERSION, client="bench", token=slot.info.token)
            stats = (await c.request("stats"))["prefix_cache"]
            queried, hit = queried + stats["query_tokens"], hit + stats["hit_tokens"]
        finally:
            c.close()
    return queried, hit


async def run_all(backend: ClusterBackend, prompts: list[str], max_tokens: int, concurrency: int) -> int:
    """Runs the prompts ``concurrency`` at a time; returns the tokens generated."""
    assert backend.cluster is not None
    pool = backend.cluster
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> int:
        async with gate:
            args = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            async for ev in pool.run("text-completion", args):
                if ev.kind == "result" and ev.result is not None:
                    return len(ev.result["token_ids"])
        return 0

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def measure(home: Path, engines: int, policy: str, a: argparse.Namespace, scaling: bool) -> Row:
    words = ["--kv-pages", "512", "--weights", "fp32", "--no-compile", "--pass-cost-rows", "0", "--threads", "1"]
    words += ["--simulate-step-ms", str(a.step_ms), "--max-batch-tokens", str(a.max_batch_tokens)]
    spec = EngineSpec([TINY], words, env={"PIE_HOME": str(home)})
    backend = ClusterBackend(spec, engines, router=RouterConfig(policy=policy), engine_cpus=0.5)  # type: ignore[arg-type]
    await backend.start()
    assert backend.state == "ready", backend.error
    assert backend.cluster is not None
    try:
        rate = None
        if scaling:  # first, while no engine holds more of the tree than another: prompts alternate
            prompts = [f"Stream {i}: count the books on shelf {i}." for i in range(16)]
            t0 = time.perf_counter()
            tokens = await run_all(backend, prompts, 64, 16)
            rate = tokens / (time.perf_counter() - t0)
            print(f"{engines} engine(s), {policy}: 16 runs placed {_spread(backend.cluster.placements)}")
        before = len(backend.cluster.placements)
        if not a.affinity:
            return Row(f"{engines} engine{'s' if engines > 1 else ''}", rate, float("nan"), "")
        queried0, hit0 = await engine_prefix_stats(backend)
        firsts = [f"{system(s)}\nUser 0: when do you open?" for s in range(a.systems)]
        rest = [f"{system(s)}\nUser {u}: can I borrow {u} books?" for u in range(1, a.users) for s in range(a.systems)]
        random.Random(0).shuffle(rest)  # arrivals in no pattern a round robin could fall in step with
        await run_all(backend, firsts, 4, 1)
        await run_all(backend, rest, 4, 8)
        queried, hit = await engine_prefix_stats(backend)
        queried, hit = queried - queried0, hit - hit0
        label = f"{engines} engine{'s' if engines > 1 else ''}, {policy.replace('_', '-')}"
        return Row(label, rate, hit / max(queried, 1), _spread(backend.cluster.placements[before:]))
    finally:
        await backend.close(5)


def _spread(placements: list[tuple[str, str, str]]) -> str:
    """Runs per engine, as "engine-0:8 engine-1:8"."""
    counts: dict[str, int] = {}
    for _, engine, _ in placements:
        counts[engine] = counts.get(engine, 0) + 1
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=50.0, help="simulated step time of each engine")
    p.add_argument("--max-batch-tokens", type=int, default=8, help="rows an engine takes a step")
    p.add_argument("--systems", type=int, default=8, help="distinct system prompts")
    p.add_argument("--users", type=int, default=4, help="requests per system prompt")
    p.add_argument("--no-affinity", dest="affinity", action="store_false", help="measure the scaling only")
    a = p.parse_args()
    home = tiny_home()
    try:
        rows = [
            await measure(home, 1, "cache_aware", a, scaling=True),
            await measure(home, 2, "cache_aware", a, scaling=True),
        ]
        if a.affinity:
            rows.append(await measure(home, 2, "round_robin", a, scaling=False))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    base = rows[0].tokens_per_s or 1.0
    print(f"\nsleep engines: tiny model, fp32, 1 thread each, {a.step_ms} ms a step, {a.max_batch_tokens} rows a step")
    print(f"{'setup':<28}{'tok/s (16 runs)':>18}{'vs 1 engine':>13}{'prefix hit rate':>18}   affinity runs per engine")
    for r in rows:
        tps = f"{r.tokens_per_s:.1f}" if r.tokens_per_s else "-"
        ratio = f"{r.tokens_per_s / base:.2f}x" if r.tokens_per_s else "-"
        hits = "-" if r.hit_rate != r.hit_rate else f"{r.hit_rate:.1%}"  # NaN: not measured
        print(f"{r.setup:<28}{tps:>18}{ratio:>13}{hits:>18}   {r.placements}")


if __name__ == "__main__":
    asyncio.run(main())
