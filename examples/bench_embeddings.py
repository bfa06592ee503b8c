"""`/v1/embeddings` throughput: `pie serve` against llama-server (``--embeddings --pooling mean``) on the same
model, the same inputs and the same client.

    python examples/bench_embeddings.py [--inputs 256] [--tokens 64] [--batch 16] [--concurrency 4]
                                        [--threads 2] [--weights int4] [--against llama-server]

The load: ``--inputs`` different texts of ``--tokens`` tokens each (the benchmark prompts' text from an offset
of each input's own), sent as requests of ``--batch`` inputs, ``--concurrency`` requests at once, mean pooling,
float vectors. Per server: inputs/s and input tokens/s over the wall time, after one warm-up request.
llama-server is built on demand (``pie_runtime.bench.llama_server_env``) and runs on the packaged GGUF of the
default model (Q4_1) with ``-t THREADS``; when it cannot be built the bench says why and measures pie alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable

from pie_runtime.bench.llama_server import ServerChild, free_port, llama_server
from pie_runtime.bench.prompts import NAMED, prompt_text
from pie_runtime.bench.serve_load import chat_prompts
from pie_runtime.store import DEFAULT_MODEL, ModelStore


def texts(model: str, count: int, length: int) -> list[str]:
    from inferlet.tokenizer import Tokenizer

    tok = Tokenizer((ModelStore().path(model) / "tokenizer.json").read_text(), [], None, None)
    return chat_prompts(tok, "\n".join(prompt_text(n) for n in NAMED), count, length)


async def wave(base: str, model: str, inputs: list[str], batch: int, concurrency: int) -> tuple[float, int]:
    """All ``inputs`` in requests of ``batch``, ``concurrency`` at once; (wall seconds, input tokens counted
    by the server)."""
    import httpx

    batches = [inputs[i : i + batch] for i in range(0, len(inputs), batch)]
    gate = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(client: httpx.AsyncClient, items: list[str]) -> None:
        nonlocal tokens
        async with gate:
            body = {"model": model, "input": items, "encoding_format": "float"}
            r = await client.post(f"{base}/v1/embeddings", json=body)
            r.raise_for_status()
            out = r.json()
            assert len(out["data"]) == len(items), out
            tokens += int(out.get("usage", {}).get("prompt_tokens") or 0)

    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, b) for b in batches))
        return time.perf_counter() - t0, tokens


def pie_server(model: str, a: argparse.Namespace) -> ServerChild:
    port = free_port()
    cmd = [sys.executable, "-m", "pie_runtime.cli.main", "serve", "--model", model, "--http", f"127.0.0.1:{port}"]
    cmd += ["--threads", str(a.threads), "--weights", a.weights, "--embedding-pooling", "mean"]
    return ServerChild("pie serve", f"http://127.0.0.1:{port}", cmd)


def llama(model: str, a: argparse.Namespace) -> ServerChild | None:
    from pie_runtime.bench import llama_cpp_env, llama_server_env

    try:
        gguf = llama_cpp_env.model_gguf(model)
        binary = llama_server_env.ensure_llama_server(lambda line: print(line, file=sys.stderr))
    except (llama_cpp_env.LlamaCppUnavailable, RuntimeError) as e:
        print(f"llama-server skipped: {e}", file=sys.stderr)
        return None
    words = ["--embeddings", "--pooling", "mean", "-t", str(a.threads), "-c", str(8 * a.tokens * a.batch)]
    words += ["-b", str(a.tokens * a.batch), "-ub", str(a.tokens * a.batch), "--parallel", str(a.concurrency)]
    return llama_server(binary, gguf, words)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--inputs", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", default="int4")
    p.add_argument("--against", choices=["llama-server"], default=None)
    a = p.parse_args()
    model = DEFAULT_MODEL
    inputs = texts(model, a.inputs, a.tokens)
    starts: list[tuple[str, Callable[[], ServerChild | None]]] = [("pie serve", lambda: pie_server(model, a))]
    if a.against:
        starts.append(("llama-server", lambda: llama(model, a)))
    rates = {}
    for name, start in starts:
        server = start()
        if server is None:
            continue
        try:
            asyncio.run(wave(server.base, model, inputs[:2], 2, 1))  # first-call costs
            wall, tokens = asyncio.run(wave(server.base, model, inputs, a.batch, a.concurrency))
        finally:
            server.stop()
        rates[name] = len(inputs) / wall
        print(f"{name}: {len(inputs)} inputs ({tokens} tokens) in {wall:.2f} s: {rates[name]:.1f} inputs/s, "
              f"{tokens / wall:.0f} tokens/s", flush=True)  # fmt: skip
    if len(rates) == 2:
        print(f"pie serve / llama-server: {rates['pie serve'] / rates['llama-server']:.2f}x")
    print(f"load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
