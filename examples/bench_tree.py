"""Chain against tree speculation, per drafter, on one engine: for each configuration the decode rate, its
ratio to text-completion measured in the same sweep, the mean accepted depth (drafts kept per round: a tree's
kept path) and the verify window's rows per round, on the mixed and repetitive prompts of `pie bench
speculation`. Every configuration runs ``--repeats`` times, interleaved, and reports its median; on a noisy
machine read the ratios, not the rates.

    .venv/bin/python examples/bench_tree.py [--weights int4] [--threads N] [--max-tokens 128] [--repeats 2] [--mtp]

``--mtp`` adds the MTP head's chain and tree (the default model needs a head attached: `pie drafter`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess

from rich.console import Console
from rich.table import Table

from pie_runtime.bench.prompts import prompt_text
from pie_runtime.launcher import EmbeddedEngine, resolve_inferlet, run_inferlet
from pie_runtime.store import DEFAULT_MODEL

LOOKUP = "cacheback-speculative-decoding"
MTP = "mtp-speculative-decoding"
CONFIGS: dict[str, list[tuple[str, str, list[str]]]] = {  # drafter → (label, inferlet, words)
    "lookup": [
        ("chain adaptive (k<=16)", LOOKUP, []),
        ("chain fixed k=8", LOOKUP, ["--draft-schedule", "fixed", "--draft-length", "8"]),
        ("tree 4,2,1,1,1,1 adaptive", LOOKUP, ["--tree", "4,2,1,1,1,1"]),
        ("tree 4,2,1,1,1,1 fixed", LOOKUP, ["--tree", "4,2,1,1,1,1", "--draft-schedule", "fixed"]),
        ("tree 3,1,1,1,1,1,1,1 fixed", LOOKUP, ["--tree", "3,1,1,1,1,1,1,1", "--draft-schedule", "fixed"]),
        ("tree 2,1x11 adaptive", LOOKUP, ["--tree", ",".join(["2"] + ["1"] * 11)]),
        ("tree 2,1x11 fixed", LOOKUP, ["--tree", ",".join(["2"] + ["1"] * 11), "--draft-schedule", "fixed"]),
    ],
    "mtp": [
        ("chain k=2", MTP, ["--draft-length", "2"]),
        ("tree 3,2", MTP, ["--draft-length", "2", "--tree", "3,2"]),
        ("tree 4,1 fixed", MTP, ["--draft-length", "2", "--tree", "4,1", "--draft-schedule", "fixed"]),
    ],
}


def run(address: str, inferlet: str, prompt: str, words: list[str], max_tokens: int) -> dict:
    common = ["--prompt", prompt, "--stream", "false", "--max-tokens", str(max_tokens)]
    out = run_inferlet(resolve_inferlet(inferlet), address, common + words, stdout=subprocess.DEVNULL)
    if not out["ok"]:
        raise RuntimeError(f"{inferlet} {words}: {out.get('error')}")
    return out["result"]


def sweep(args: argparse.Namespace) -> list[dict]:
    drafters = ["lookup"] + (["mtp"] if args.mtp else [])
    rows: list[dict] = []
    threads = ["--threads", str(args.threads)] if args.threads else []
    with EmbeddedEngine([DEFAULT_MODEL], ["--weights", args.weights, *threads]) as eng:
        run(eng.address, "text-completion", "warm up", [], 4)
        for prompt_name in args.prompts:
            prompt = prompt_text(prompt_name)
            runs: dict[str, list[dict]] = {}
            reference: list[int] | None = None
            for _ in range(args.repeats):
                base = run(eng.address, "text-completion", prompt, [], args.max_tokens)
                reference = base["token_ids"]
                runs.setdefault("text-completion", []).append(base)
                for drafter in drafters:
                    for label, inferlet, words in CONFIGS[drafter]:
                        runs.setdefault(f"{drafter}: {label}", []).append(
                            run(eng.address, inferlet, prompt, words, args.max_tokens)
                        )
            base_rate = statistics.median(r["stats"]["decode_tokens_per_s"] for r in runs["text-completion"])
            for name, results in runs.items():
                s = [r["stats"] for r in results]
                rate = statistics.median(x["decode_tokens_per_s"] for x in s)
                rows.append(
                    {
                        "prompt": prompt_name,
                        "config": name,
                        "tok_per_s": round(rate, 1),
                        "vs_text_completion": round(rate / base_rate, 2) if base_rate else None,
                        "accepted_depth": round(statistics.fmean(x.get("accepted_depth", 0.0) for x in s), 2),
                        "rows_per_round": round(statistics.fmean(x.get("rows_per_round", 1.0) for x in s), 2),
                        "tree_round_share": round(
                            statistics.fmean(
                                x.get("tree_rounds", 0) / x["rounds"] if x.get("rounds") else 0.0 for x in s
                            ),
                            2,
                        ),
                        "greedy_match": all(r["token_ids"] == reference for r in results),
                    }
                )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default="int4")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="the engine's torch threads")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", nargs="+", default=["mixed", "repetitive"])
    p.add_argument("--mtp", action="store_true", help="also the MTP head (attached to the default model)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = sweep(args)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    table = Table(
        title=f"chain vs tree speculation ({args.weights}, {args.max_tokens} tokens, median of {args.repeats})"
    )
    for col in rows[0]:
        table.add_column(col.replace("_", " "))
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    Console().print(table)


if __name__ == "__main__":
    main()
