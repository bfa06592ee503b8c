"""What a hostile API key costs another key's streaming chat on one `pie serve` (issue 57's aim): the honest
key's decode token rate and time to first token, quiet against under the hostile key's loop
(examples/hostile_tenant.py), in alternating phases of one run.

    python examples/tenant_interference.py [--phase-seconds 60] [--rounds 2] [--max-tokens 64] [--json OUT]
        [-- SERVE FLAGS...]

It starts `pie serve --allow-upload` with two keys (from a key file, not argv) on a free loopback port. In each
phase the honest key sends streaming chat requests one after another (greedy, ``--max-tokens``); a request's
TTFT is its first content chunk's time after sending, its rate (content chunks - 1) / (last - first chunk). A
hostile phase runs the hostile loop beside it for the phase's length. It prints, per kind of phase, the
requests, TTFT p50 and the median token rate, and the hostile phases' ratios to the quiet ones. Nothing is
asserted: the figures go to docs/measurements-tenants.md with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from hostile_tenant import hostile_loop, key_file, unexpected
from soak_serve import start_server

HONEST, HOSTILE = "honest-key-5a1e", "hostile-key-9d0b"
PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."


async def chat(client: httpx.AsyncClient, model: str, max_tokens: int) -> tuple[float, float, int] | None:
    """One streamed chat: (ttft s, decode tokens/s, content chunks), None when it failed."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    sent = time.monotonic()
    stamps: list[float] = []
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=_auth(HONEST)) as r:
        if r.status_code != 200:
            await r.aread()
            return None
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    stamps.append(time.monotonic())
    if len(stamps) < 2:
        return None
    return stamps[0] - sent, (len(stamps) - 1) / (stamps[-1] - stamps[0]), len(stamps)


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def phase(url: str, model: str, seconds: float, hostile: bool, max_tokens: int) -> dict:
    stop = time.monotonic() + seconds
    loop = asyncio.create_task(hostile_loop(url, HOSTILE, stop)) if hostile else None
    samples, failed = [], 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while time.monotonic() < stop:
            got = await chat(client, model, max_tokens)
            if got is None:
                failed += 1
            else:
                samples.append(got)
    outcomes = await loop if loop is not None else None
    return {
        "hostile": hostile,
        "requests": len(samples),
        "failed": failed,
        "ttft_s": [s[0] for s in samples],
        "rate_tok_s": [s[1] for s in samples],
        "hostile_outcomes": dict(outcomes) if outcomes is not None else None,
        "hostile_unexpected": dict(unexpected(outcomes)) if outcomes is not None else None,
    }


def summary(phases: list[dict], hostile: bool) -> dict:
    mine = [p for p in phases if p["hostile"] == hostile]
    ttft = [t for p in mine for t in p["ttft_s"]]
    rate = [r for p in mine for r in p["rate_tok_s"]]
    return {
        "requests": len(ttft),
        "failed": sum(p["failed"] for p in mine),
        "ttft_p50_ms": round(statistics.median(ttft) * 1e3, 1) if ttft else None,
        "rate_median_tok_s": round(statistics.median(rate), 1) if rate else None,
    }


async def measure(url: str, a: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models", headers=_auth(HONEST))).json()["data"][0]["id"]
        for _ in range(2):  # warm-up
            await chat(client, model, a.max_tokens)
    phases = []
    for _ in range(a.rounds):
        for hostile in (False, True):
            p = await phase(url, model, a.phase_seconds, hostile, a.max_tokens)
            print(f"{'hostile' if hostile else 'quiet  '} phase: {summary([p], hostile)}", flush=True)
            phases.append(p)
    quiet, loud = summary(phases, False), summary(phases, True)
    ratios = {}
    if quiet["rate_median_tok_s"] and loud["rate_median_tok_s"]:
        ratios["rate"] = round(loud["rate_median_tok_s"] / quiet["rate_median_tok_s"], 3)
    if quiet["ttft_p50_ms"] and loud["ttft_p50_ms"]:
        ratios["ttft_p50"] = round(loud["ttft_p50_ms"] / quiet["ttft_p50_ms"], 3)
    print(f"quiet: {quiet}\nhostile: {loud}\nhostile / quiet: {ratios}")
    print(f"load average at the end: {os.getloadavg()}")
    return {"quiet": quiet, "hostile": loud, "ratios": ratios, "phases": phases, "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--phase-seconds", type=float, default=60.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    keys = Path(tempfile.mkstemp(prefix="pie-keys-", suffix=".json")[1])
    keys.write_text(json.dumps(key_file([HONEST], HOSTILE)))
    log = Path(tempfile.mkstemp(prefix="pie-interference-", suffix=".log")[1])
    serve_flags = ["--keys", str(keys), "--allow-upload", "--stream-stall-timeout", "5", *flags]
    proc, url = start_server(a.model, serve_flags, log)
    print(f"pie serve (pid {proc.pid}) on {url}, its log in {log}", flush=True)
    try:
        out = asyncio.run(measure(url, a))
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        keys.unlink()
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
