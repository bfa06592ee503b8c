"""Run-ahead benchmark: per-token decode time of the host-driven loop (one fire and one reply per token)
against run-ahead (the engine re-fires the pass itself; the inferlet only takes tokens), at batch 1, for
text-completion and, where the model has an MTP drafter and the inferlet has a run-ahead mode, MTP.

    PIE_HOME=... .venv/bin/python examples/bench_run_ahead.py [--models smollm2-135m tiny-smol] [--tokens 64]

On a small or random model the forward is cheap, so the round trip per token is a large share of the
time and run-ahead's gain shows; on a large model both converge to the forward's cost.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess

from rich.console import Console
from rich.table import Table

from pie_runtime.launcher import EmbeddedEngine, resolve_inferlet, run_inferlet
from pie_runtime.store import DEFAULT_MODEL, ModelStore

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the weather, the sea and the keeper's thoughts.")


def decode_ms_per_token(address: str, inferlet: str, tokens: int, extra: list[str]) -> tuple[float, list[int]]:
    words = ["--prompt", PROMPT, "--max-tokens", str(tokens), "--stream", "false", *extra]
    out = run_inferlet(resolve_inferlet(inferlet), address, words, stdout=subprocess.DEVNULL)
    if not out["ok"]:
        raise RuntimeError(out["error"])
    res = out["result"]
    rate = res["stats"].get("decode_tokens_per_s") or 0.0
    return (1e3 / rate if rate else float("nan")), res["token_ids"]


def variants(model: str) -> list[tuple[str, str, list[str]]]:
    out = [("text-completion", "text-completion", [])]
    manifest = ModelStore().get(model)
    if any(d.kind == "mtp" for d in manifest.drafters):
        try:
            resolve_inferlet("mtp-speculative-decoding")
            out.append(("mtp", "mtp-speculative-decoding", []))
        except Exception:  # noqa: BLE001 - the MTP inferlet may not be installed
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=[DEFAULT_MODEL])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="engine torch threads (0: its default)")
    args = ap.parse_args()

    table = Table(title=f"batch-1 decode, {args.tokens} tokens, median of {args.repeats}")
    for col in ("model", "inferlet", "host loop ms/token", "run-ahead ms/token", "speedup", "same tokens"):
        table.add_column(col)
    for model in args.models:
        extra = ["--threads", str(args.threads)] if args.threads else []
        engine = EmbeddedEngine([model], extra)
        try:
            for label, name, words in variants(model):
                decode_ms_per_token(engine.address, name, 8, words)  # warm-up
                host, ahead, same = [], [], True
                for _ in range(args.repeats):
                    h, h_ids = decode_ms_per_token(engine.address, name, args.tokens, words)
                    a, a_ids = decode_ms_per_token(engine.address, name, args.tokens, [*words, "--run-ahead"])
                    host.append(h)
                    ahead.append(a)
                    same &= h_ids == a_ids
                h, a = statistics.median(host), statistics.median(ahead)
                table.add_row(model, label, f"{h:.2f}", f"{a:.2f}", f"{h / a:.2f}x", str(same))
        finally:
            engine.stop()
    Console().print(table)


if __name__ == "__main__":
    main()
