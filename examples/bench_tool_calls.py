"""A tool-call request against the same request without tools, alternated on one `pie serve`.

    python examples/bench_tool_calls.py ROUNDS

Per round one streamed chat request with ``tools=[get_weather]`` and ``tool_choice="required"``, then the same
messages without tools (``ignore_eos``), 64 tokens each, greedy: the client's decode rate (first to last
delta) and the inferlet host's CPU milliseconds a token (not corrected for its idle rate).
"""

import argparse
import json
import os
import sys
import time

import bench_http_vs_run as b
import httpx

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "unit", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}}
]


def run(base, tools, pids):
    body = {
        "model": "smollm2-135m",
        "messages": [
            {"role": "user", "content": "What will the weather be in Paris for the next days? Answer with detail."}
        ],
        "max_tokens": 64,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tools:
        body |= {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": True}
    else:
        body |= {"ignore_eos": True}
    c0 = b.cpu_s(pids["host"])
    first, last = 0.0, 0.0
    tokens = 0
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=900) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if ch.get("usage"):
                tokens = ch["usage"]["completion_tokens"]
            for c in ch.get("choices") or []:
                d = c.get("delta") or {}
                if d.get("content") or d.get("tool_calls"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
    cpu = (b.cpu_s(pids["host"]) - c0) / max(tokens, 1) * 1e3
    return (tokens - 1) / (last - first), tokens, cpu


a = argparse.Namespace(threads=2, weights="int4")
srv, _ = b.start_server("smollm2-135m", a, None)
try:
    pids = b.roles(srv.proc.pid)
    run(srv.base, True, pids)
    run(srv.base, False, pids)
    for r in range(int(sys.argv[1])):
        t = run(srv.base, True, pids)
        p = run(srv.base, False, pids)
        line = f"round {r}: tools {t[0]:.1f} tok/s ({t[1]} tokens, host {t[2]:.2f} ms/token); "
        line += f"plain {p[0]:.1f} tok/s ({p[1]} tokens, host {p[2]:.2f} ms/token); ratio {t[0] / p[0]:.3f}"
        print(f"{line}; load {os.getloadavg()}", flush=True)
finally:
    srv.stop()
