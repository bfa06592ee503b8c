"""`pie bench speculation --workload json-facts|code-classes|mixed-text`: text-completion, cacheback and suffix
decoding on many requests, run one after the other in one process against one engine (``bench/workloads.py``),
compared.

    pie bench speculation --workload json-facts [--requests 64] [--seed 0] [--max-tokens 128] [--json]
                          [-- suffix-speculative-decoding's flags, e.g. --tree-rows 16]

All three are greedy chat runs with the same token budget; each request's three runs go in turns. Prints, per
inferlet: decode tok/s, tokens per forward, acceptance overall and per draft position, its ratio to
text-completion (suffix: to cacheback too), how many requests returned text-completion's tokens; and the memory
of a suffix store holding the suffix runs' outputs, per 1,000 requests.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from ..bench.workload_report import compare, store_bytes_per_1000
from ..bench.workloads import prompts, run_workload
from ..launcher import EmbeddedEngine, LaunchError, resolve_inferlet
from ..store import DEFAULT_MODEL

RUNS = (
    ("text-completion", "text-completion"),
    ("cacheback", "cacheback-speculative-decoding"),
    ("suffix", "suffix-speculative-decoding"),
)


def measure_workload(args: argparse.Namespace, served_setup: Callable[[list[str], list[str]], dict]) -> dict:
    """Runs the workload on a new embedded engine; returns the comparison (``workload_report.compare``) and
    ``served_setup(models, engine flags)`` (the weight formats and threads, bench.py's)."""
    texts = prompts(args.workload, args.requests, args.seed)
    common = ["--chat", "--max-tokens", str(args.max_tokens)]
    runs = [
        (label, resolve_inferlet(name), common + (args.inferlet_args if label == "suffix" else []))
        for label, name in RUNS
    ]
    models = args.model or [DEFAULT_MODEL]
    with EmbeddedEngine(models, args.engine_arg, die_with_parent=True) as eng:
        run_workload(eng.address, runs[:1], texts[:1])  # warm-up: first-call costs, not a request
        by_label = run_workload(eng.address, runs, texts, progress=True)
        setup = served_setup(models, args.engine_arg)
    out = compare(by_label)
    return {
        "workload": args.workload,
        "requests": args.requests,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        **setup,
        **out,
        "suffix_store": store_bytes_per_1000([r["token_ids"] for r in by_label["suffix"]]),
    }


def print_workload(m: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    labels = [label for label, _ in RUNS]
    table = Table(title=f"speculation workload {m['workload']}: {m['requests']} requests, seed {m['seed']}")
    table.add_column("measure")
    for label in labels:
        table.add_column(label, overflow="fold")
    keys = dict.fromkeys(k for label in labels for k in m[label])
    for key in keys:
        cells = [m[label].get(key, "") for label in labels]
        table.add_row(key.replace("_", " "), *(json.dumps(c) if isinstance(c, list) else str(c) for c in cells))
    Console().print(table)
    print(f"weights {m['weights']}, threads {m['threads']}; suffix store: {json.dumps(m['suffix_store'])}")


def workload_command(args: argparse.Namespace, served_setup: Callable[[list[str], list[str]], dict]) -> int:
    if args.requests < 1:
        print("error: --requests must be at least 1", file=sys.stderr)
        return 2
    try:
        m = measure_workload(args, served_setup)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(m))
    else:
        print_workload(m)
    return 0
