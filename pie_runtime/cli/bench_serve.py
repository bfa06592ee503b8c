"""`pie bench serve`: the same HTTP load on `pie serve` (and with a speculation policy, and on llama-server),
one server after the other, against the same requests as `pie run` processes on one engine.

    pie bench serve [--model NAME] [--concurrency 1,4,16,32,64] [--max-tokens 128] [--prompt-tokens 128]
                    [--against llama-server] [--policy 3:8] [--runs 1] [--quick] [--json]

The load (``pie_runtime.bench.serve_load``): at each concurrency ``c``, ``c`` streaming chat completions at
once, each with a user message of its own (``--prompt-tokens`` tokens: "Request i: " and the benchmark
prompts' text from an offset of its own, so no two share a cached prefix), greedy, ``--max-tokens`` tokens
each with ``ignore_eos``. Every server gets the same requests. Per wave: tok/s (generated tokens over the
wall time), requests/s, TTFT and ITL p50/p99 and the median request's decode rate; per server, the peak RSS
of its whole process tree (server, engine, hosts), sampled over its run.

``--against llama-server`` builds llama.cpp's server on demand (``pie_runtime.bench.llama_server_env``) and
runs it on the packaged GGUF of the default model (Q4_1) with ``--parallel P -c 1024P -t T``: ``P`` the
largest concurrency, at least 32, ``T`` the engine's ``--threads`` (default 2). When it cannot be built the
bench says why in one line and goes on. ``--runs N`` runs the first N requests of the concurrency-1 wave
as ``N`` concurrent `pie run text-completion` processes on one engine (N = 1: the same request, whose decode
rate the concurrency-1 HTTP path is compared with). ``--quick``: concurrency 1,2, 8 tokens, 32-token prompts,
no policy (a smoke test).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

from ..bench.llama_server import ServerChild, free_port, llama_server, server_words
from ..bench.prompts import NAMED, prompt_text
from ..bench.rss import TreePeak
from ..bench.serve_load import Row, chat_prompts, chat_wave, percentile, row_of
from .engine import add_engine_options

PIE = "pie serve"
LLAMA = "llama-server"


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="the same HTTP load on pie serve (± a policy, llama-server) and pie run")
    p.add_argument("--model", default=None, help="a model in the store (default: the default model)")
    p.add_argument("--concurrency", default="1,4,16,32,64", help="comma-separated concurrency levels")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens each request generates (ignore_eos)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="tokens of each request's user message")
    p.add_argument("--against", choices=[LLAMA], default=None, help="also run llama-server on the packaged GGUF")
    p.add_argument("--policy", default="", help="also a server with --draft-lookup NGRAM:K (e.g. 3:8)")
    p.add_argument("--runs", type=int, default=1, help="concurrent `pie run` processes for contrast (0 skips)")
    p.add_argument("--quick", action="store_true", help="concurrency 1,2, 8 tokens, 32-token prompts, no policy")
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    add_engine_options(p)
    p.set_defaults(func=_bench_serve)


def serve_process(model: str, engine_words: list[str], extra: list[str]) -> ServerChild:
    """A `pie serve` child on a free port, started and ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "pie_runtime.cli.main", "serve", "--model", model]
    cmd += ["--http", f"127.0.0.1:{port}", *engine_words, *extra]
    return ServerChild(PIE, f"http://127.0.0.1:{port}", cmd)


def bench_server(
    label: str, server: ServerChild, waves: dict[int, list[str]], model: str, max_tokens: int
) -> list[Row]:
    """Runs each wave (concurrency → its prompts) on a started ``server``, then stops it; every row carries
    the peak RSS of the server's process tree over the whole run."""
    rows = []
    peak = TreePeak(server.proc.pid).start()
    try:
        asyncio.run(chat_wave(server.base, model, ["Warm up: say hello."], 8))  # first-call costs
        for prompts in waves.values():
            samples, wall = asyncio.run(chat_wave(server.base, model, prompts, max_tokens))
            rows.append(row_of(label, samples, wall))
            print(json.dumps(asdict(rows[-1])), file=sys.stderr, flush=True)
    finally:
        server.stop()
        top = peak.stop()
    for r in rows:
        r.peak_rss_mib = round(top, 1)
    return rows


def bench_pie_run(model: str, engine_words: list[str], prompts: list[str], max_tokens: int) -> Row:
    """One concurrent `pie run text-completion --chat` process per prompt on one engine (the pre-`pie serve`
    way); its decode rate is the inferlets' own (after the prefill), as the HTTP rows' is the client's; its
    tok/s counts the processes' start, its peak RSS is the engine's."""
    from ..launcher import EmbeddedEngine, resolve_inferlet, run_inferlet

    n = len(prompts)
    path = resolve_inferlet("text-completion")
    results: list[dict] = [{} for _ in range(n)]
    with EmbeddedEngine([model], engine_words, die_with_parent=True) as eng:
        peak = TreePeak(eng.proc.pid).start()
        warm = ["--prompt", "Warm up: say hello.", "--chat", "--max-tokens", "8"]
        run_inferlet(path, eng.address, warm, stdout=subprocess.DEVNULL)

        def go(i: int) -> None:
            words = ["--prompt", prompts[i], "--chat", "--max-tokens", str(max_tokens), "--ignore-eos"]
            results[i] = run_inferlet(path, eng.address, [*words, "--stream", "false"], stdout=subprocess.DEVNULL)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        top = peak.stop()
    ok = [r["result"] for r in results if r.get("ok")]
    tokens = sum(len(r.get("token_ids", [])) for r in ok)
    rate = percentile([float(r["stats"]["decode_tokens_per_s"]) for r in ok], 50)
    return Row(
        f"pie run x {n}", n, n, tokens, round(wall, 2), round(tokens / wall, 1), round(len(ok) / wall, 2),
        decode_tok_s=rate, peak_rss_mib=round(top, 1), errors=n - len(ok),
    )  # fmt: skip


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def print_rows(rows: list[Row], note: str) -> None:
    """One table, grouped by concurrency; a row's ratios are `pie serve`'s figure over its own."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"pie bench serve ({note})")
    cols = ("conc.", "server", "tok/s", "pie÷this", "req/s", "TTFT p50 ms", "pie÷this", "TTFT p99 ms",
            "ITL p50 ms", "ITL p99 ms", "decode tok/s", "pie÷this", "peak RSS MiB")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col == "server" else "right")

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:g}"

    ref = {r.concurrency: r for r in rows if r.server == PIE}
    for r in sorted(rows, key=lambda r: r.concurrency):
        p = ref.get(r.concurrency) if r.server != PIE else None
        table.add_row(
            str(r.concurrency), r.server + (f" ({r.errors} failed: {r.error[:60]})" if r.errors else ""),
            f(r.tok_s), _ratio(p.tok_s, r.tok_s) if p else "", f(r.req_s),
            f(r.ttft_p50_ms), _ratio(p.ttft_p50_ms, r.ttft_p50_ms) if p else "", f(r.ttft_p99_ms),
            f(r.itl_p50_ms), f(r.itl_p99_ms), f(r.decode_tok_s), _ratio(p.decode_tok_s, r.decode_tok_s) if p else "",
            f(r.peak_rss_mib),
        )  # fmt: skip
    Console(width=200).print(table)


def _llama_server(model: str, parallel: int, threads: int, progress: Callable[[str], None]) -> ServerChild | None:
    """A started llama-server on the GGUF the model was imported from, or None after saying in one line why not."""
    from ..bench import llama_cpp_env, llama_server_env

    try:
        gguf = llama_cpp_env.model_gguf(model)
        binary = llama_server_env.ensure_llama_server(progress)
        return llama_server(binary, gguf, server_words(max(parallel, 32), threads))
    except (llama_cpp_env.LlamaCppUnavailable, RuntimeError) as e:
        progress(f"llama-server skipped: {e}")
        return None


def _waves(model: str, levels: list[int], prompt_tokens: int) -> dict[int, list[str]]:
    """Concurrency → its requests' user messages, different for every request of the whole bench."""
    from inferlet.tokenizer import Tokenizer

    from ..store import ModelStore

    folder = ModelStore().path(model)
    tok = Tokenizer((folder / "tokenizer.json").read_text(), [], None, None)
    source = "\n".join(prompt_text(name) for name in NAMED)
    waves, first = {}, 0
    for c in levels:
        waves[c] = chat_prompts(tok, source, c, prompt_tokens, first)
        first += c
    return waves


def _bench_serve(args: argparse.Namespace) -> int:
    from ..store import DEFAULT_MODEL
    from .serve import engine_words

    if args.quick:
        args.concurrency, args.max_tokens, args.prompt_tokens, args.policy = "1,2", 8, 32, ""
    model = args.model or DEFAULT_MODEL
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    words = engine_words(args)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    waves = _waves(model, levels, args.prompt_tokens)
    rows = bench_server(PIE, serve_process(model, words, []), waves, model, args.max_tokens)
    if args.policy:
        server = serve_process(model, words, ["--draft-lookup", args.policy])
        rows += bench_server(f"{PIE} --draft-lookup {args.policy}", server, waves, model, args.max_tokens)
    if args.against == LLAMA:
        threads = int(getattr(args, "threads", None) or 2)
        llama = _llama_server(model, max(levels), threads, progress)
        if llama is not None:
            rows += bench_server(LLAMA, llama, waves, model, args.max_tokens)
    if args.runs:
        first = [p for c, ps in waves.items() for p in ps][: args.runs]
        rows.append(bench_pie_run(model, words, first, args.max_tokens))
    if args.json:
        for r in rows:
            print(json.dumps(asdict(r)))
    else:
        note = f"streaming chat, {args.prompt_tokens}-token prompts, {args.max_tokens} tokens, greedy, ignore_eos"
        print_rows(rows, note)
    return 0
