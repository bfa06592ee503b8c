"""Prefix-cache benchmark: time to first token of a chat request whose ~512-token system prompt the engine has
not seen (cold), against a second request sharing that system prompt with another question (warm: the engine
maps the cached pages of the shared prefix and computes only the rest).

    PIE_HOME=... .venv/bin/python examples/bench_prefix_cache.py [--model smollm2-135m] [--system-tokens 512]
        [--trials 3] [--threads 2] [--engine-args "--weights bf16"]

Each trial uses a fresh system prompt (its first words name the trial, so no page of an earlier trial
matches). The first token is the greedy argmax of the prompt's last row, read by one fire from this process
(no inferlet process start in the figure). The same pairs run against an engine with ``--no-prefix-cache``
for contrast; "same" checks that both engines gave the same first tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import time

from rich.console import Console
from rich.table import Table

import inferlet
from pie_runtime.launcher import EmbeddedEngine
from pie_runtime.store import DEFAULT_MODEL

RULES = [
    "The harbour opens at dawn and closes at dusk.",
    "Boats longer than twelve metres must book a berth a day ahead.",
    "The fuel pontoon takes cash and cards.",
    "The lighthouse shows two white flashes every ten seconds.",
    "The fish market sells from six until nine in the morning.",
    "The chandlery on Quay Street closes on Sundays.",
    "Dinghies are left on the slipway racks, never on the pontoons.",
    "Anchoring inside the breakwater is forbidden in an easterly gale.",
    "The harbour office answers on channel twelve from eight to six.",
    "Showers and laundry are behind the lifeboat station; the code changes weekly.",
]
QUESTIONS = ["When does the fish market open?", "How often does the lighthouse flash?"]


def system_prompt(model: inferlet.Model, trial: int, tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens, different from its first words for each trial."""
    lines = [f"Trial {trial}. You are the harbour master of Wrenmouth and answer visiting sailors briefly."]
    i = 0
    while len(model.tokenizer.encode(" ".join(lines))) < tokens:
        lines.append(f"Rule {i + 1}: {RULES[i % len(RULES)]}")
        i += 1
    return " ".join(lines)


async def first_token(model: inferlet.Model, ids: list[int]) -> tuple[float, int, int]:
    """(seconds to the first token, the token, rows taken from the prefix cache) of one fresh working set."""
    ws = model.working_set()
    try:
        t0 = time.perf_counter()
        res = await inferlet.ForwardPass(ws).embed(ids).readout([len(ids) - 1], inferlet.Argmax()).submit()
        return time.perf_counter() - t0, int(res.tokens[0]), ws.cached_rows
    finally:
        await ws.release()


async def trials(address: str, first: int, n: int, system_tokens: int) -> list[dict]:
    session = await inferlet.connect(address)
    model = session.model()
    out = []
    try:
        for trial in range(first, first + n):
            system = system_prompt(model, trial, system_tokens)
            row: dict = {"system_tokens": len(model.tokenizer.encode(system))}
            for label, question in zip(("cold", "warm"), QUESTIONS):
                text = model.tokenizer.chat(
                    [{"role": "system", "content": system}, {"role": "user", "content": question}]
                )
                ids = model.tokenizer.encode(text)
                secs, token, cached = await first_token(model, ids)
                row[label] = {"s": secs, "token": token, "cached": cached, "prompt": len(ids)}
            out.append(row)
    finally:
        session.client.close()
    return out


def run_engine(model: str, extra: list[str], n: int, system_tokens: int) -> list[dict]:
    with EmbeddedEngine([model], ["--pass-cost-rows", "0", *extra]) as eng:
        asyncio.run(trials(eng.address, -1, 1, system_tokens))  # warms the engine's kernels up, not its cache
        return asyncio.run(trials(eng.address, 0, n, system_tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="engine torch threads (default: torch's)")
    ap.add_argument("--engine-args", default="", help="more `pie engine` options, one shell-quoted string")
    args = ap.parse_args()
    extra = shlex.split(args.engine_args) + (["--threads", str(args.threads)] if args.threads else [])
    runs = {
        "prefix cache": run_engine(args.model, extra, args.trials, args.system_tokens),
        "--no-prefix-cache": run_engine(args.model, [*extra, "--no-prefix-cache"], args.trials, args.system_tokens),
    }
    table = Table(title=f"time to first token, {args.model} ({' '.join(extra) or 'default options'})")
    for col in ("engine", "system tokens", "prompt", "cold ms", "warm ms", "warm cached rows", "warm / cold"):
        table.add_column(col, justify="right")
    for name, rows in runs.items():
        for r in rows:
            c, w = r["cold"], r["warm"]
            table.add_row(
                name,
                str(r["system_tokens"]),
                f"{c['prompt']}/{w['prompt']}",
                f"{c['s'] * 1e3:.0f}",
                f"{w['s'] * 1e3:.0f}",
                str(w["cached"]),
                f"{w['s'] / c['s']:.3f}",
            )
    Console(width=140).print(table)
    cached, plain = runs["prefix cache"], runs["--no-prefix-cache"]
    ratio = statistics.median(r["warm"]["s"] / r["cold"]["s"] for r in cached)
    same = all(a[k]["token"] == b[k]["token"] for a, b in zip(cached, plain) for k in ("cold", "warm"))
    print(f"median warm/cold with the prefix cache: {ratio:.3f} (aim <= 0.25); first tokens same: {same}")


if __name__ == "__main__":
    main()
