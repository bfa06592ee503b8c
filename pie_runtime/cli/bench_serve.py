"""`pie bench serve`: load on `pie serve`'s HTTP API, with and without a speculation policy, against the same
requests as separate `pie run` processes.

    pie bench serve [--model NAME] [--concurrency 1,4,16,32] [--max-tokens 64] [--policy 3:8] [--json]

For each server (no policy, then ``--draft-lookup POLICY``) one `pie serve` process is started on a free
port; at each concurrency ``c`` an asyncio load generator (httpx) sends ``c`` streaming completions at once
(greedy, the mixed prompt; at concurrency 1 also the repetitive one) and measures per request the time to
first token and the gaps between text chunks (inter-token latency), and for the wave the generated tokens
over its wall time. Then the same ``--runs`` requests go as ``--runs`` concurrent `pie run text-completion`
processes on one engine (their tokens over the wall time). One table: tok/s, TTFT p50/p99, ITL p50/p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

from ..bench.prompts import prompt_text
from .engine import add_engine_options


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="HTTP load on `pie serve` (with and without a policy) vs `pie run` processes")
    p.add_argument("--model", default=None, help="a model in the store (default: the default model)")
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated concurrency levels")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates")
    p.add_argument("--policy", default="3:8", help="the --draft-lookup NGRAM:K of the policy server ('' skips it)")
    p.add_argument("--runs", type=int, default=16, help="concurrent `pie run` processes for contrast (0 skips)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    add_engine_options(p)
    p.set_defaults(func=_bench_serve)


@dataclass
class Row:
    server: str
    prompt: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    tok_s: float
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    errors: int = 0


@dataclass
class _Sample:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[i]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client, url: str, body: dict) -> _Sample:
    out = _Sample()
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"]["message"]
                    continue
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if not out.ttft:
                        out.ttft = now - t0
                    else:
                        out.gaps.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal to the bench
        out.error = f"{type(e).__name__}: {e}"
    return out


async def wave(base: str, model: str, prompt: str, concurrency: int, max_tokens: int) -> tuple[list[_Sample], float]:
    """``concurrency`` streaming completions at once; (their samples, the wave's wall seconds)."""
    import httpx

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        t0 = time.perf_counter()
        samples = await asyncio.gather(*(_one(client, f"{base}/v1/completions", body) for _ in range(concurrency)))
        return list(samples), time.perf_counter() - t0


def row_of(server: str, prompt: str, concurrency: int, samples: list[_Sample], wall: float) -> Row:
    ok = [s for s in samples if not s.error]
    tokens = sum(s.tokens for s in ok)
    gaps = [g for s in ok for g in s.gaps]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 1)

    return Row(
        server=server,
        prompt=prompt,
        concurrency=concurrency,
        requests=len(samples),
        tokens=tokens,
        wall_s=round(wall, 2),
        tok_s=round(tokens / wall, 1) if wall > 0 else 0.0,
        ttft_p50_ms=ms(percentile([s.ttft for s in ok], 50)),
        ttft_p99_ms=ms(percentile([s.ttft for s in ok], 99)),
        itl_p50_ms=ms(percentile(gaps, 50)),
        itl_p99_ms=ms(percentile(gaps, 99)),
        errors=len(samples) - len(ok),
    )


class ServeProcess:
    """A `pie serve` child on a free port, up until ``stop()``."""

    def __init__(self, model: str, engine_words: list[str], extra: list[str], timeout: float = 900) -> None:
        import httpx

        self.base = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "pie_runtime.cli.main", "serve", "--model", model]
        cmd += ["--http", self.base.removeprefix("http://"), *engine_words, *extra]
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - open for the child's life, closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"pie serve exited {self.proc.returncode}: {self.log.read()[-2000:]}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("pie serve did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def bench_server(
    label: str, model: str, engine_words: list[str], extra: list[str], levels: list[int], max_tokens: int
) -> list[Row]:
    rows = []
    server = ServeProcess(model, engine_words, extra)
    try:
        asyncio.run(wave(server.base, model, prompt_text("mixed"), 1, 8))  # warm-up: first-call costs
        for c in levels:
            prompts = ["repetitive", "mixed"] if c == 1 else ["mixed"]
            for name in prompts:
                samples, wall = asyncio.run(wave(server.base, model, prompt_text(name), c, max_tokens))
                rows.append(row_of(label, name, c, samples, wall))
                print(json.dumps(asdict(rows[-1])), file=sys.stderr, flush=True)
    finally:
        server.stop()
    return rows


def bench_pie_run(model: str, engine_words: list[str], n: int, max_tokens: int) -> Row:
    """``n`` concurrent `pie run text-completion` processes on one engine (the pre-`pie serve` way)."""
    from ..launcher import EmbeddedEngine, resolve_inferlet, run_inferlet

    prompt = prompt_text("mixed")
    words = ["--prompt", prompt, "--max-tokens", str(max_tokens), "--ignore-eos", "--stream", "false"]
    path = resolve_inferlet("text-completion")
    results: list[dict] = [{} for _ in range(n)]
    with EmbeddedEngine([model], engine_words, die_with_parent=True) as eng:
        run_inferlet(path, eng.address, ["--prompt", prompt, "--max-tokens", "4"], stdout=subprocess.DEVNULL)

        def go(i: int) -> None:
            results[i] = run_inferlet(path, eng.address, words, stdout=subprocess.DEVNULL)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    ok = [r["result"] for r in results if r.get("ok")]
    tokens = sum(len(r.get("token_ids", [])) for r in ok)
    return Row("pie run x N", "mixed", n, n, tokens, round(wall, 2), round(tokens / wall, 1), errors=n - len(ok))


def print_rows(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="pie bench serve (greedy, ignore_eos; tok/s = generated tokens / wave wall time)")
    for col in ("server", "prompt", "conc.", "tokens", "wall s", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"):
        table.add_column(col, justify="left" if col in ("server", "prompt") else "right")

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:g}"

    for r in rows:
        table.add_row(
            r.server + (f" ({r.errors} failed)" if r.errors else ""),
            r.prompt,
            str(r.concurrency),
            str(r.tokens),
            f(r.wall_s),
            f(r.tok_s),
            f(r.ttft_p50_ms),
            f(r.ttft_p99_ms),
            f(r.itl_p50_ms),
            f(r.itl_p99_ms),
        )
    Console(width=160).print(table)


def _bench_serve(args: argparse.Namespace) -> int:
    from ..store import DEFAULT_MODEL
    from .serve import engine_words

    model = args.model or DEFAULT_MODEL
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    words = engine_words(args)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    rows = bench_server("serve", model, words, [], levels, args.max_tokens)
    if args.policy:
        label = f"serve --draft-lookup {args.policy}"
        rows += bench_server(label, model, words, ["--draft-lookup", args.policy], levels, args.max_tokens)
    if args.runs:
        rows.append(bench_pie_run(model, words, args.runs, args.max_tokens))
    if args.json:
        for r in rows:
            print(json.dumps(asdict(r)))
    else:
        print_rows(rows)
    return 0
