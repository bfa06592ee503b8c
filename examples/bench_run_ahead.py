"""Run-ahead benchmark: per-token decode time at batch 1 of the host-driven loop (one fire and one reply per
step or round) against the same loop on the device, for

    text-completion                  host loop  vs  --run-ahead (the engine re-fires the pass itself)
    mtp-speculative-decoding         host loop  vs  --run-ahead (draft, verify, fold, next window: all in
                                                    the engine's epilogue; the inferlet only takes tokens)
    cacheback-speculative-decoding   host loop  vs  --device-verify (lookup drafts from the host, verify and
                                                    fold in the fire's epilogue: one message a round)

    PIE_HOME=... .venv/bin/python examples/bench_run_ahead.py [--models smollm2-135m tiny-smol] [--tokens 64]
        [--mtp-head MODEL=FILE ...] [--train-mtp MODEL ...] [--threads 1]

MTP rows need a model with an MTP head: the benchmark serves a private store (model files linked, manifests
copied) with ``--mtp-head`` heads attached (by default the shipped head,
pie_runtime/assets/drafters/smollm2-135m-mtp.safetensors, on the default model) and heads trained for a few
seconds for ``--train-mtp`` models (tiny-smol: agreement is not the point there, the per-round cost is).
Greedy runs: "same" checks that both paths return the same tokens and the same speculative stats (rounds,
proposed, accepted).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pie_runtime.distill import CORPUS_ENV, corpus_folders, find_corpus
from pie_runtime.drafters import attach
from pie_runtime.launcher import EmbeddedEngine, resolve_inferlet, run_inferlet
from pie_runtime.store import DEFAULT_MODEL, MANIFEST_FILE, ModelStore

PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the weather, the sea and the keeper's thoughts."
)
HERE = Path(__file__).resolve().parent
DEFAULT_HEAD = HERE.parent / "pie_runtime" / "assets" / "drafters" / "smollm2-135m-mtp.safetensors"
FALLBACK_CORPUS = (
    HERE.parent / "pie_runtime" / "assets" / "prompts" / "mixed.txt"
)  # agreement is not the point of a --train-mtp head


def training_corpus() -> Path:
    """The corpus the --train-mtp heads learn from: austen.txt from $PIE_CORPUS_DIR or shared/corpus/ beside the
    repository, else (saying so) the shipped mixed prompt."""
    corpus = find_corpus("austen.txt")
    if corpus is None:
        searched = ", ".join(str(f) for f in corpus_folders())
        print(
            f"no austen.txt in {searched} (set {CORPUS_ENV} to a folder holding it): training on "
            f"{FALLBACK_CORPUS.relative_to(HERE.parent)}",
            file=sys.stderr,
        )
        return FALLBACK_CORPUS
    return corpus


def decode(address: str, inferlet: str, tokens: int, extra: list[str]) -> tuple[float, dict]:
    """(ms per decoded token, result) of one run."""
    words = ["--prompt", PROMPT, "--max-tokens", str(tokens), "--stream", "false", *extra]
    out = run_inferlet(resolve_inferlet(inferlet), address, words, stdout=subprocess.DEVNULL)
    if not out["ok"]:
        raise RuntimeError(out["error"])
    rate = out["result"]["stats"].get("decode_tokens_per_s") or 0.0
    return (1e3 / rate if rate else float("nan")), out["result"]


def private_store(models: list[str], heads: dict[str, Path], train: list[str], threads: int) -> Path:
    """A PIE_HOME whose models link to the real store's files, with MTP heads attached to the copies."""
    home = Path(tempfile.mkdtemp(prefix="pie-bench-"))
    real = ModelStore()
    for model in models:
        dst = home / "models" / model
        dst.mkdir(parents=True)
        for f in real.path(model).iterdir():
            if f.name == MANIFEST_FILE:
                shutil.copyfile(f, dst / f.name)
            elif not f.name.startswith("."):  # weights, tokenizer, attached drafters' folders
                (dst / f.name).symlink_to(f.resolve(), target_is_directory=f.is_dir())
    store = ModelStore(home / "models")
    corpus = training_corpus() if train else None
    for model in train:  # seconds of training: a head that runs, not one that agrees
        out = home / f"{model}-mtp.safetensors"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pie_runtime.cli.main",
                "drafter",
                "train",
                "--model",
                model,
                "--kind",
                "mtp",
                "--depth",
                "3",
                "--corpus",
                str(corpus),
                "--tokens",
                "1024",
                "--seq-len",
                "128",
                "--heldout-tokens",
                "128",
                "--epochs",
                "2",
                "--out",
                str(out),
                "--threads",
                str(threads or 1),
                "--train-threads",
                "1",
                "--cache-dir",
                "none",
                "--quiet",
            ],
            check=True,
            env={**os.environ, "PIE_HOME": str(home)},
            capture_output=True,
        )
        heads[model] = out
    for model, head in heads.items():
        attach(store, model, f"mtp:{head}", "bench")
    return home


def variants(model: str, home: Path) -> list[tuple[str, str, list[str], str]]:
    """(label, inferlet, its words, the on-device flag)."""
    out = [("text-completion", "text-completion", [], "--run-ahead")]
    if any(d.kind == "mtp" for d in ModelStore(home / "models").get(model).drafters):
        # the host loop at a fixed 3 too (its default schedule adapts k): the same rounds as the device's
        mtp = ["--draft-length", "3", "--draft-schedule", "fixed"]
        out.append(("mtp k=3", "mtp-speculative-decoding", mtp, "--run-ahead"))
    out.append(("cacheback k=4", "cacheback-speculative-decoding", [], "--device-verify"))
    return out


SAME_STATS = ("rounds", "proposed", "accepted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=[DEFAULT_MODEL])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="engine torch threads (0: its default)")
    ap.add_argument("--mtp-head", action="append", default=[], metavar="MODEL=FILE")
    ap.add_argument("--train-mtp", action="append", default=[], metavar="MODEL")
    args = ap.parse_args()

    heads = dict(h.split("=", 1) for h in args.mtp_head)
    if not heads and DEFAULT_MODEL in args.models and DEFAULT_HEAD.is_file():
        heads[DEFAULT_MODEL] = str(DEFAULT_HEAD)
    home = private_store(args.models, {m: Path(f) for m, f in heads.items()}, args.train_mtp, args.threads)

    table = Table(title=f"batch-1 decode, {args.tokens} tokens, median of {args.repeats}")
    for col in (
        "model",
        "inferlet",
        "host loop ms/token",
        "on device ms/token",
        "speedup",
        "accepted/proposed",
        "same tokens+stats",
    ):
        table.add_column(col)
    try:
        for model in args.models:
            extra = ["--threads", str(args.threads)] if args.threads else []
            engine = EmbeddedEngine([model], extra, env={"PIE_HOME": str(home)})
            try:
                for label, name, words, flag in variants(model, home):
                    decode(engine.address, name, 8, words)  # warm-up
                    host, dev, same = [], [], True
                    for _ in range(args.repeats):
                        h, h_res = decode(engine.address, name, args.tokens, words)
                        d, d_res = decode(engine.address, name, args.tokens, [*words, flag])
                        host.append(h)
                        dev.append(d)
                        same &= h_res["token_ids"] == d_res["token_ids"] and all(
                            h_res["stats"].get(k) == d_res["stats"].get(k) for k in SAME_STATS
                        )
                    h, d = statistics.median(host), statistics.median(dev)
                    s = d_res["stats"]
                    acc = f"{s['accepted']}/{s['proposed']}" if "proposed" in s else "-"
                    table.add_row(model, f"{label} ({flag})", f"{h:.2f}", f"{d:.2f}", f"{h / d:.2f}x", acc, str(same))
            finally:
                engine.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    Console().print(table)


if __name__ == "__main__":
    main()
