"""The load `pie bench serve` puts on an OpenAI-compatible server (`pie serve` or llama-server), the same for
both: ``c`` streaming chat completions at once, each with its own prompt of a stated length, greedy, a fixed
output length (``max_tokens`` with ``ignore_eos``). Per request it records the time to the first content
chunk (TTFT), the gaps between content chunks (inter-token latency, ITL) and the tokens generated (the usage
chunk's count, else one a content chunk); per wave the tokens and requests over its wall time.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from inferlet.tokenizer import Tokenizer


@dataclass
class Sample:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    chunks: int = 0
    decode_s: float = 0.0  # first content chunk to last
    error: str = ""


@dataclass
class Row:
    """One wave on one server."""

    server: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    tok_s: float
    req_s: float
    decode_tok_s: float | None = None  # per request, median: tokens after the first over first-to-last chunk
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    peak_rss_mib: float | None = None  # the server's whole process tree, sampled over the run
    errors: int = 0
    error: str = ""  # the first failed request's error


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[i]


def chat_prompts(tok: Tokenizer, source: str, count: int, length: int, first: int = 0) -> list[str]:
    """``count`` different user messages of ``length`` tokens each, requests ``first`` to ``first + count - 1``:
    "Request i: " (so no two share a cached prefix) and then ``source``'s tokens from an offset of the
    request's own (wrapping around), decoded."""
    ids = tok.encode(source)
    if not ids:
        raise ValueError("the prompt source has no tokens")
    out = []
    for i in range(first, first + count):
        head = tok.encode(f"Request {i}: ")
        start = (i * 97) % len(ids)
        out.append(tok.decode(head + [ids[(start + k) % len(ids)] for k in range(max(length - len(head), 0))]))
    return out


def _take(out: Sample, chunk: dict, t0: float, last: float) -> float:
    """Records one SSE chunk of a chat stream; returns the time of the latest content chunk."""
    if "error" in chunk:
        out.error = str(chunk["error"].get("message", chunk["error"]))
        return last
    if chunk.get("usage"):
        out.tokens = int(chunk["usage"].get("completion_tokens") or 0)
    if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
        now = time.perf_counter()
        out.chunks += 1
        if not out.ttft:
            out.ttft = now - t0
        else:
            out.gaps.append(now - last)
        return now
    return last


async def one_chat(client, url: str, body: dict) -> Sample:
    out = Sample()
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return out
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = _take(out, json.loads(line[6:]), t0, last)
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal to the bench
        out.error = f"{type(e).__name__}: {e}"
    out.tokens = out.tokens or out.chunks
    out.decode_s = last - t0 - out.ttft if out.ttft else 0.0
    return out


def chat_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # vLLM's and llama-server's field: a fixed output length
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def chat_wave(base: str, model: str, prompts: list[str], max_tokens: int) -> tuple[list[Sample], float]:
    """One streaming chat completion per prompt, all at once; (their samples, the wave's wall seconds)."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        url = f"{base}/v1/chat/completions"
        t0 = time.perf_counter()
        samples = await asyncio.gather(*(one_chat(client, url, chat_body(model, p, max_tokens)) for p in prompts))
        return list(samples), time.perf_counter() - t0


def row_of(server: str, samples: list[Sample], wall: float, peak_rss: float | None = None) -> Row:
    ok = [s for s in samples if not s.error]
    tokens = sum(s.tokens for s in ok)
    gaps = [g for s in ok for g in s.gaps]
    rates = [(s.tokens - 1) / s.decode_s for s in ok if s.decode_s > 0 and s.tokens > 1]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 1)

    rate = percentile(rates, 50)
    return Row(
        server=server,
        concurrency=len(samples),
        requests=len(samples),
        tokens=tokens,
        wall_s=round(wall, 2),
        tok_s=round(tokens / wall, 1) if wall > 0 else 0.0,
        req_s=round(len(ok) / wall, 2) if wall > 0 else 0.0,
        decode_tok_s=None if rate is None else round(rate, 1),
        ttft_p50_ms=ms(percentile([s.ttft for s in ok], 50)),
        ttft_p99_ms=ms(percentile([s.ttft for s in ok], 99)),
        itl_p50_ms=ms(percentile(gaps, 50)),
        itl_p99_ms=ms(percentile(gaps, 99)),
        peak_rss_mib=None if peak_rss is None else round(peak_rss, 1),
        errors=len(samples) - len(ok),
        error=next((s.error for s in samples if s.error), ""),
    )
