"""Issue 56's admission aim through `pie serve`: how many concurrent 4,000-token Gemma 3 completions one fixed KV
budget runs at once with KV page groups and with every row kept (``--kv-swa-full``).

    python examples/serve_long_gemma.py [--model gemma3-270m] [--kv-mib 160] [--requests 8] [--rows 4000]
        [--max-tokens 16] [--threads 2] [--layouts groups,swa-full]

For each layout it starts `pie serve --model M --kv-memory MIB` (``--kv-swa-full`` for the second), fires
``--requests`` concurrent ``/v1/completions`` whose prompts are ``--rows`` distinct token ids each (the base model
has no chat template; distinct prompts, so the prefix cache shares nothing), scrapes ``/metrics`` every two
seconds while they run, and stops the server. Per layout one JSON line: requests completed (status 200) and
failed, the most that ran at once (``pie_requests_running_max``: the server's KV admission lets a run in once its
KV bound fits the pool), the most KV pages and bytes the engine held (``pie_kv_pages_used`` / ``usage_ratio``
scraped), its pages per page group at that moment, wall seconds and the server's start seconds. A last line: the
ratio of runs at once, page groups over all rows kept. Prints JSON lines; a server's log is kept in a temporary
file named in its line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SAMPLE = re.compile(r"^(pie_[a-z_]+)(\{[^}]*\})? (\S+)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(page: str) -> dict[str, float]:
    """``name{labels}`` → value of every pie_ sample on a /metrics page."""
    out = {}
    for line in page.splitlines():
        m = SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def start(args: argparse.Namespace, swa_full: bool) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="pie-serve-long-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "pie_runtime.cli.main", "serve", "--model", args.model, "--http", f"127.0.0.1:{port}"]
    cmd += ["--kv-memory", str(args.kv_mib), "--threads", str(args.threads), "--pass-cost-rows", "0"]
    cmd += ["--max-tokens", str(max(args.max_tokens, 16))] + (["--kv-swa-full"] if swa_full else [])
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://127.0.0.1:{port}", log


async def wait_ready(c: httpx.AsyncClient, proc: subprocess.Popen, log: Path) -> None:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"pie serve exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            if (await c.get("/health", timeout=10)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(1.0)


async def fire(c: httpx.AsyncClient, args: argparse.Namespace, seed: int) -> tuple[int, str]:
    rng = random.Random(seed)
    ids = [2] + [rng.randrange(1000, 200_000) for _ in range(args.rows - 1)]  # 2: Gemma's BOS
    body = {"model": args.model, "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0}
    r = await c.post("/v1/completions", json=body, timeout=None)
    return r.status_code, "" if r.status_code == 200 else r.text[:300]


async def watch(c: httpx.AsyncClient, seen: dict) -> None:
    """Keeps the scrape with the most KV pages used, and how slow the slowest /metrics answer was."""
    while True:
        t0 = time.monotonic()
        try:
            got = scrape((await c.get("/metrics", timeout=60)).text)
        except httpx.HTTPError as e:
            seen["metrics_errors"] = seen.get("metrics_errors", 0) + 1
            seen["last_error"] = repr(e)
            got = {}
        seen["slowest_metrics_s"] = max(seen.get("slowest_metrics_s", 0.0), round(time.monotonic() - t0, 2))
        used = next((v for k, v in got.items() if k.startswith("pie_kv_pages_used")), None)
        if used is not None and used >= seen.get("pages_used", -1):
            seen.update(pages_used=used, scrape=got)
        await asyncio.sleep(2.0)


async def one_layout(args: argparse.Namespace, swa_full: bool) -> dict:
    proc, base, log = start(args, swa_full)
    t0 = time.monotonic()
    try:
        async with httpx.AsyncClient(base_url=base) as c:
            await wait_ready(c, proc, log)
            started_s = time.monotonic() - t0
            seen: dict = {}
            watcher = asyncio.create_task(watch(c, seen))
            t1 = time.monotonic()
            outcomes = await asyncio.gather(*(fire(c, args, seed) for seed in range(args.requests)))
            wall = time.monotonic() - t1
            watcher.cancel()
            final = scrape((await c.get("/metrics", timeout=120)).text)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    most = seen.get("scrape", {})
    ratio = next((v for k, v in most.items() if k.startswith("pie_kv_usage_ratio")), 0.0)
    groups = {k.split("group=")[1].split(",")[0].strip('"'): v for k, v in most.items() if "kv_group_pages" in k}
    return {
        "layout": "swa-full" if swa_full else "groups",
        "kv_mib": args.kv_mib,
        "requests": args.requests,
        "rows": args.rows,
        "completed": sum(1 for s, _ in outcomes if s == 200),
        "failures": [t for s, t in outcomes if s != 200],
        "most_at_once": next((v for k, v in final.items() if k.startswith("pie_requests_running_max")), None),
        "most_kv_pages": seen.get("pages_used"),
        "most_kv_mib": round(ratio * args.kv_mib, 2),
        "pages_per_group_then": groups,
        "slowest_metrics_s": seen.get("slowest_metrics_s"),
        "metrics_errors": seen.get("metrics_errors", 0),
        "wall_s": round(wall, 1),
        "start_s": round(started_s, 1),
        "load_average": os.getloadavg()[0],
        "log": str(log),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--kv-mib", type=int, default=160)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layouts", default="groups,swa-full")
    args = p.parse_args()
    lines = {}
    for layout in args.layouts.split(","):
        lines[layout] = asyncio.run(one_layout(args, layout == "swa-full"))
        print(json.dumps(lines[layout]), flush=True)
    if {"groups", "swa-full"} <= set(lines):
        a, b = lines["groups"]["most_at_once"], lines["swa-full"]["most_at_once"]
        print(json.dumps({"at_once_ratio": round(a / b, 2) if a and b else None}), flush=True)


if __name__ == "__main__":
    main()
