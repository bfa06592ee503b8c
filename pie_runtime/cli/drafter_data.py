"""`pie drafter data`: the target's own chat answers, made on a real engine, for drafter training.

    pie drafter data --out ../runs/chat-data --tokens 200000 --minutes 40
    pie drafter train --model smollm2-135m --kind mtp --data ../runs/chat-data ... --init HEAD

A seeded prompt set (pie_runtime/distill/chat_prompts.py: templates over corpus passages and topics, held-out
prompts from held-out passages, topics and templates) is answered in the model's chat template by an engine this
command starts (or ``--engine ADDRESS``), ``--concurrency`` answers at once so that the engine batches their
steps; held-out prompts greedy, training prompts greedy or sampled at 0.7 or 1.0. The answers, their token ids and
the engine's hidden state of every position, go to append-only shards in ``--out`` (answer_shards.py). A second
run with the same settings continues where the first stopped; ``--tokens`` and ``--minutes`` bound each run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from .engine import add_engine_options

PROMPT_SET_VERSION = 2  # raise when chat_prompts.py's templates change: a folder's prompts would no longer match


def register(dsub: argparse._SubParsersAction) -> None:
    p = dsub.add_parser("data", help="have the engine answer a seeded chat prompt set; shards of token ids + hidden")
    p.add_argument("--model", default=None, help="the target model in the store (default: the default model)")
    p.add_argument("--out", required=True, help="the data folder (created; a folder with a manifest is continued)")
    p.add_argument("--corpus", action="append", default=None, help="passage source (default ../shared/corpus/*.txt)")
    p.add_argument("--prompts", type=int, default=6000, help="training prompts in the set")
    p.add_argument("--heldout", type=int, default=48, help="held-out prompts (answered first, greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, default=262_144, help="stop at this many answer tokens in the folder")
    p.add_argument("--minutes", type=float, default=None, help="stop this run after this many minutes")
    p.add_argument("--max-new", type=int, default=192, help="answer tokens at most per prompt")
    p.add_argument("--concurrency", type=int, default=16, help="answers decoded at once (rows per engine step)")
    p.add_argument("--flush", type=int, default=32, help="answers per shard")
    p.add_argument("--engine", default=None, help="address of a running engine (default: start one)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_options(p)
    p.set_defaults(func=run_data)


def _corpora(args: argparse.Namespace) -> list[Path]:
    from ..distill.data import find_corpus
    from ..store import StoreError

    if args.corpus:
        paths = [Path(c).expanduser() for c in args.corpus]
    else:
        paths = [p for p in (find_corpus("austen.txt"), find_corpus("kjv.txt")) if p is not None]
        if not paths:
            raise StoreError("no corpus found in ../shared/corpus/ or $PIE_CORPUS_DIR: name one with --corpus FILE")
    for p in paths:
        if not p.is_file():
            raise StoreError(f"no such corpus file: {p}")
    return paths


def _settings(args: argparse.Namespace, model: str, corpora: list[Path], fmt: str) -> dict:
    """What makes a folder's data: a resumed run must match it."""
    return {
        "model": model,
        "weights": fmt,
        "corpus": [c.name for c in corpora],
        "prompts": args.prompts,
        "heldout": args.heldout,
        "seed": args.seed,
        "max_new": args.max_new,
        "prompt_set": PROMPT_SET_VERSION,
    }


def run_data(args: argparse.Namespace) -> int:
    from ..distill.answer_shards import DataError, done_keys, open_folder
    from ..distill.chat_prompts import heldout_prompts, training_prompts
    from ..distill.self_answers import plan_jobs
    from ..drafters import served_formats
    from ..launcher import LaunchError
    from ..store import DEFAULT_MODEL, ModelStore, StoreError
    from .engine import named_format

    model = args.model or DEFAULT_MODEL
    folder = Path(args.out)
    try:
        corpora = _corpora(args)
        fmt = served_formats(ModelStore(), [model], named_format(args), {})[model]  # as the engine decides it
        manifest = open_folder(folder, _settings(args, model, corpora, fmt))
    except (StoreError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    train, held = training_prompts(corpora, args.prompts, args.seed), heldout_prompts(corpora, args.heldout, args.seed)
    jobs = plan_jobs(train, held, args.seed, done_keys(folder))
    if manifest.answer_tokens >= args.tokens or not jobs:
        print(f"{folder}: {manifest.answers} answers, {manifest.answer_tokens} answer tokens: nothing to do")
        return 0
    try:
        _generate(args, model, folder, manifest, jobs)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _generate(args: argparse.Namespace, model: str, folder: Path, manifest, jobs: list) -> None:
    """Runs the workers against ``--engine`` or an engine started here; prints the run's throughput."""
    from tqdm import tqdm

    from ..distill.answer_shards import Answer, append_shard
    from ..distill.self_answers import Budget, generate
    from ..launcher import EmbeddedEngine
    from .run import engine_args

    t0 = time.monotonic()
    budget = Budget(args.tokens - manifest.answer_tokens, t0 + args.minutes * 60 if args.minutes else None)
    pending: list[Answer] = []
    bar = tqdm(total=budget.tokens, unit="tok", desc="answers", disable=args.quiet, smoothing=0.05)

    def on_answer(a: Answer) -> None:
        pending.append(a)
        bar.update(len(a.tokens) - a.prompt_len)
        if len(pending) >= args.flush:
            append_shard(folder, manifest, pending)
            pending.clear()

    gen_args = {"jobs": jobs, "budget": budget, "max_new": args.max_new, "on_answer": on_answer}
    if args.engine:
        asyncio.run(generate(args.engine, gen_args, args.concurrency))
    else:
        with EmbeddedEngine([model], engine_args(args), die_with_parent=True) as eng:
            t0 = time.monotonic()  # the engine's start is not the data's
            asyncio.run(generate(eng.address, gen_args, args.concurrency))
    append_shard(folder, manifest, pending)
    bar.close()
    s = time.monotonic() - t0
    print(
        f"{folder}: +{budget.tokens_done} answer tokens in {s:.0f} s ({budget.tokens_done / max(s, 1e-9):.1f} tok/s, "
        f"{budget.fires} fires, {args.concurrency} working sets at once); in all {manifest.answers} answers, "
        f"{manifest.answer_tokens} answer tokens"
    )
