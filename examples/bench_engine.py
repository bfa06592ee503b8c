"""Engine benchmark: batch-1 decode through `pie run` against transformers on the same checkpoint and
prompt, aggregate throughput with 1, 4 and 16 concurrent text-completion inferlets, and the time each
engine step spends outside the model forward (its overhead).

    .venv/bin/python examples/bench_engine.py [--model smollm2-135m] [--tokens 64] [--concurrency 1 4 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import inferlet
from pie_runtime.launcher import EmbeddedEngine, resolve_inferlet, run_inferlet
from pie_runtime.store import DEFAULT_MODEL, ModelStore

PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the weather, the sea and the keeper's thoughts."
)


async def engine_stats(address: str) -> dict:
    session = await inferlet.connect(address)
    try:
        return await session.client.request("stats")
    finally:
        session.client.close()


def run_text_completion(address: str, tokens: int, seed: int | None = None) -> dict:
    words = ["--prompt", PROMPT, "--max-tokens", str(tokens), "--chat", "--stream", "false"]
    if seed is not None:
        words += ["--temperature", "0.8", "--seed", str(seed)]
    out = run_inferlet(resolve_inferlet("text-completion"), address, words, stdout=subprocess.DEVNULL)
    if not out["ok"]:
        raise RuntimeError(out["error"])
    return out["result"]


def transformers_decode_rate(model_name: str, tokens: int) -> float:
    import torch
    from tokenizers import Tokenizer

    from pie_runtime.reference import transformers_llama

    store = ModelStore()
    manifest = store.get(model_name)
    with tempfile.TemporaryDirectory() as tmp:
        hf = transformers_llama(store.path(model_name), manifest.config, Path(tmp))
        tok = Tokenizer.from_file(str(store.path(model_name) / "tokenizer.json"))
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if manifest.tokenizer.chat_template is None:
            raise SystemExit(f"{model_name} has no chat template: the transformers run needs one")
        text = (
            ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            .from_string(manifest.tokenizer.chat_template)
            .render(messages=[{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        )
        ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids])

        def gen(n):
            t0 = time.perf_counter()
            with torch.no_grad():
                # transformers types generate()'s self by a protocol that its own models do not satisfy
                hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)  # pyright: ignore[reportAttributeAccessIssue]
            return time.perf_counter() - t0

        gen(2)  # warm-up
        prefill = gen(1)
        total = gen(tokens + 1)
        return tokens / (total - prefill)


async def concurrent(address: str, n: int, tokens: int) -> float:
    """Aggregate tokens per second of ``n`` text-completion runs at once (wall clock, prefill included)."""
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(loop.run_in_executor(None, run_text_completion, address, tokens, i) for i in range(n))
    )
    wall = time.perf_counter() - t0
    generated = sum(len(r["token_ids"]) for r in results)
    return generated / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--skip-transformers", action="store_true")
    args = p.parse_args()
    console = Console()

    with EmbeddedEngine([args.model], ["--kv-pages", "2048"]) as engine:
        run_text_completion(engine.address, 4)  # warm-up
        # two runs that differ only in decode steps: their difference is pure batch-1 decode
        s0 = asyncio.run(engine_stats(engine.address))
        short = run_text_completion(engine.address, 4)
        s1 = asyncio.run(engine_stats(engine.address))
        single = run_text_completion(engine.address, args.tokens + 4)
        s2 = asyncio.run(engine_stats(engine.address))

        def delta(key: str) -> float:
            return (s2[key] - s1[key]) - (s1[key] - s0[key])

        steps = delta("steps")
        step_ms = 1e3 * delta("step_s") / steps
        overhead_ms = 1e3 * (delta("step_s") - delta("forward_s")) / steps
        client_ms = (
            1e3
            * (
                len(single["token_ids"]) / single["stats"]["decode_tokens_per_s"]
                - len(short["token_ids"]) / short["stats"]["decode_tokens_per_s"]
            )
            / steps
        )
        conc = {n: asyncio.run(concurrent(engine.address, n, args.tokens)) for n in args.concurrency}
        engine_rss = (
            int(
                subprocess.run(
                    ["ps", "-o", "rss=", "-p", str(engine.proc.pid)], capture_output=True, text=True
                ).stdout.strip()
                or 0
            )
            // 1024
        )

    ours = single["stats"]["decode_tokens_per_s"]
    table = Table(title=f"pie engine, {args.model}, {args.tokens} tokens, fp32 CPU")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("ratio", justify="right")
    table.add_row("batch-1 decode, pie run (tok/s)", f"{ours:.1f}", "")
    if not args.skip_transformers:
        ref = transformers_decode_rate(args.model, args.tokens)
        table.add_row("batch-1 decode, transformers generate (tok/s)", f"{ref:.1f}", f"{ours / ref:.2f}x pie/hf")
    for n, agg in conc.items():
        table.add_row(
            f"{n} concurrent inferlets: aggregate tok/s (wall, incl. prefill)",
            f"{agg:.1f}",
            f"{agg / conc[args.concurrency[0]]:.2f}x vs {args.concurrency[0]}",
        )
    table.add_row("batch-1 engine step (ms)", f"{step_ms:.2f}", "")
    table.add_row(
        "batch-1 step time outside the forward (ms)", f"{overhead_ms:.2f}", f"{overhead_ms / step_ms:.1%} of step"
    )
    table.add_row(
        "batch-1 round trip outside the step (ms/token)", f"{client_ms - step_ms:.2f}", "inferlet + sockets + codec"
    )
    table.add_row("engine peak RSS (MiB)", f"{engine_rss}", "")
    table.add_row("bench process peak RSS (MiB)", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}", "")
    console.print(table)
    print(json.dumps({"pie_tok_s": ours, "overhead_ms": overhead_ms, "step_ms": step_ms, "concurrent": conc}))


if __name__ == "__main__":
    main()
