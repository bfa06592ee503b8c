"""Prompt-cache benchmark: the first token of a long prompt (2,000 corpus tokens by default) restored from a saved
working set against the same prompt's prefill computed again, in an engine that has never seen it.

    PIE_HOME=... .venv/bin/python examples/bench_prompt_cache.py [--tokens 2000] [--repeats 5] [--threads 2]
        [--corpus ../shared/corpus/austen.txt] [--model smollm2-135m] [--engine-args "--weights fp32"]

One engine prefills the prompt but its last token and saves the rows (``WorkingSet.save``, the prompt-cache
inferlet's file: inferlet/kv_file.py). A second, fresh engine (``--no-prefix-cache``, so that no repeat maps
an earlier one's pages) then alternates, ``--repeats`` times each: *load* (read the file, append its rows,
fire the held-back last token, read its argmax) and *recompute* (prefill the whole prompt, read the last row's
argmax). Both end at the same first token, which is checked. Reported: the median wall time of each, their
ratio, the CPU time the engine and this process spent on each (the figure to trust on a loaded machine), and
the file's size.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import inferlet
from pie_runtime.launcher import EmbeddedEngine
from pie_runtime.store import DEFAULT_MODEL

CORPUS = Path(__file__).resolve().parents[1] / ".." / "shared" / "corpus" / "austen.txt"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """Seconds of CPU (user + system) that process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@dataclass
class Timings:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # the engine's and this process's, together
    tokens: set[int] = field(default_factory=set)


def corpus_ids(model: inferlet.Model, corpus: Path, tokens: int) -> list[int]:
    """The first ``tokens`` tokens of ``corpus``."""
    text = corpus.read_text(errors="replace")[: tokens * 8]
    ids = model.tokenizer.encode(text)[:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"{corpus} holds only {len(ids)} tokens")
    return ids


async def save(address: str, corpus: Path, tokens: int, path: Path) -> list[int]:
    """Prefills the prompt but its last token on the engine at ``address`` and saves it; returns the prompt."""
    session = await inferlet.connect(address)
    try:
        model = session.model()
        ids = corpus_ids(model, corpus, tokens)
        ws = model.working_set()
        await inferlet.ForwardPass(ws).embed(ids[:-1]).submit()
        await ws.save(path, tokens=ids[:-1], pending=ids[-1:])
        await ws.release()
        return ids
    finally:
        session.client.close()


async def first_token(model: inferlet.Model, ids: list[int], path: Path | None) -> int:
    """The greedy first token after ``ids``: from the saved rows at ``path``, or computed (``path`` None)."""
    if path is None:
        ws, window = model.working_set(), ids
    else:
        ws, saved = await model.load_working_set(path)
        window = saved.pending
    try:
        fp = inferlet.ForwardPass(ws).embed(window).readout([len(window) - 1], inferlet.Argmax())
        return int((await fp.submit()).tokens[0])
    finally:
        await ws.release()


async def measure(address: str, engine_pid: int, ids: list[int], path: Path, repeats: int) -> dict[str, Timings]:
    """``repeats`` loads and recomputes, alternating, on the engine at ``address`` (after one warm-up of each)."""
    session = await inferlet.connect(address)
    out = {"load": Timings(), "recompute": Timings()}
    try:
        model = session.model()
        for r in range(repeats + 1):
            for name, source in (("load", path), ("recompute", None)):
                c0, t0 = cpu_s(engine_pid) + time.process_time(), time.perf_counter()
                token = await first_token(model, ids, source)
                wall, cpu = time.perf_counter() - t0, cpu_s(engine_pid) + time.process_time() - c0
                if r:  # the first round warms the kernels and the file cache up
                    out[name].wall.append(wall)
                    out[name].cpu.append(cpu)
                out[name].tokens.add(token)
    finally:
        session.client.close()
    return out


def report(timings: dict[str, Timings], size: int, tokens: int, label: str) -> None:
    load, comp = timings["load"], timings["recompute"]
    med = {k: (statistics.median(t.wall), statistics.median(t.cpu)) for k, t in timings.items()}
    print(f"prompt cache, {tokens} tokens, {label}; median of {len(load.wall)} repeats")
    for name in ("load", "recompute"):
        wall, cpu = med[name]
        print(f"  {name:<10} {wall * 1e3:8.1f} ms wall  {cpu * 1e3:8.1f} ms CPU (engine + client)")
    print(
        f"  recompute / load: {med['recompute'][0] / med['load'][0]:.2f}x wall, "
        f"{med['recompute'][1] / med['load'][1]:.2f}x CPU"
    )
    print(f"  file: {size / 2**20:.1f} MiB ({size / tokens / 1024:.1f} KiB a token)")
    print(f"  same first token: {load.tokens == comp.tokens and len(load.tokens) == 1}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--threads", type=int, default=None, help="engine torch threads (default: torch's)")
    ap.add_argument("--engine-args", default="", help="more `pie engine` options, one shell-quoted string")
    args = ap.parse_args(argv)
    if not args.corpus.is_file():
        raise SystemExit(f"no corpus at {args.corpus} (give one with --corpus FILE)")
    extra = ["--pass-cost-rows", "0", *shlex.split(args.engine_args)]
    extra += ["--threads", str(args.threads)] if args.threads else []
    with tempfile.TemporaryDirectory(prefix="pie-prompt-cache-") as tmp:
        path = Path(tmp) / "prompt.kv"
        with EmbeddedEngine([args.model], extra) as eng:
            ids = asyncio.run(save(eng.address, args.corpus, args.tokens, path))
        with EmbeddedEngine([args.model], [*extra, "--no-prefix-cache"]) as eng:
            timings = asyncio.run(measure(eng.address, eng.proc.pid, ids, path, args.repeats))
        report(timings, path.stat().st_size, len(ids), " ".join(extra))


if __name__ == "__main__":
    main()
