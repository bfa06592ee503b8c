"""`pie bench speculation`: one speculative inferlet against text-completion on one engine, per prompt.

    pie bench speculation --inferlet cacheback-speculative-decoding --prompt repetitive [--timing] -- --draft-length 4
    pie bench speculation --inferlet cacheback-speculative-decoding --prompt mixed --tree 4,2,1,1,1,1
    pie bench speculation --inferlet mtp-speculative-decoding --prompt mixed --prompt repetitive --repeats 3
    pie bench speculation --workload json-facts [--requests 64] [-- --tree-rows 16]     (bench_workload.py)

With ``--repeats N`` the inferlet and its control take turns N times (spec, control, control, spec, ...: a
machine that slows down during the run slows both alike), and the ratio printed is the median of the N
pairs' ratios, with their range: on a noisy CPU one pair's ratio can be off by a third.

Prints the decode rate of both, their ratio, acceptance overall and per draft position, the share of rounds
that rejected a draft, skipped rows, and a digest (sha256 of the token ids) of each output, so a greedy run
shows at a glance whether it returned text-completion's tokens. ``--control draft-length-0`` compares with
the same inferlet at draft length 0 instead (constrained decoding: the plain masked decode).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

from ..bench.prompts import expand_prompts
from ..bench.workloads import WORKLOADS
from ..launcher import EmbeddedEngine, LaunchError, resolve_inferlet, run_inferlet
from ..store import DEFAULT_MODEL, ModelStore
from .bench_decode import add_decode_parser
from .bench_serve import add_serve_parser
from .engine import add_engine_options, model_weights, named_format


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser("speculation", help="a speculative inferlet against text-completion (args after --)")
    p.add_argument("--inferlet", default=None, help="a shipped inferlet name or a .py file (needed without --workload)")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=None,
        help="many requests in one process: text-completion, cacheback and suffix decoding compared",
    )
    p.add_argument("--requests", type=int, default=64, help="--workload: how many requests")
    p.add_argument("--seed", type=int, default=0, help="--workload: the seed that draws its prompts")
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="mixed, repetitive (pie_runtime/assets/prompts), the set chat (held-out chat requests, one column "
        "each) or a file; repeatable (default repetitive)",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of the inferlet and of its control, taking turns")
    p.add_argument("--max-tokens", type=int, default=128, help="unless given after --")
    p.add_argument(
        "--model",
        action="append",
        default=None,
        help=f"models the engine serves (default {DEFAULT_MODEL}; a --draft after -- is added)",
    )
    p.add_argument("--timing", action="store_true", help="time each verify round")
    p.add_argument("--tree", default=None, help="the inferlet's --tree shape (widths per depth, e.g. 4,2,1,1)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.add_argument("--engine-arg", action="append", default=[], help="extra engine flag (repeatable)")
    p.add_argument(
        "--control",
        choices=["text-completion", "draft-length-0"],
        default="text-completion",
        help="the reference run: text-completion, or this inferlet with --draft-length 0 (for "
        "constrained decoding, whose output text-completion cannot match)",
    )
    p.set_defaults(func=_speculation)
    add_decode_parser(sub)
    add_serve_parser(sub)


def digest(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def _flag(words: list[str], name: str) -> str | None:
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return None


def served_setup(models: list[str], engine_args: list[str]) -> dict:
    """What a figure needs beside it: each served model's weight format and the engine's torch threads, decided
    from the engine's flags as the engine decides them (``drafters.served_formats``)."""
    import torch

    from ..drafters import served_formats

    p = argparse.ArgumentParser(add_help=False)
    add_engine_options(p)
    flags, _ = p.parse_known_args(engine_args)
    formats = served_formats(ModelStore(), models, named_format(flags), model_weights(flags))
    return {"weights": formats, "threads": flags.threads or torch.get_num_threads()}


def measure_prompts(
    inferlet: str,
    prompts: list[str],
    words: list[str],
    max_tokens: int = 128,
    timing: bool = False,
    models: list[str] | None = None,
    engine_args: list[str] | None = None,
    control: str = "text-completion",
    repeats: int = 1,
) -> list[dict]:
    """Runs a warm-up, then per prompt the inferlet and the control (text-completion, or the inferlet with
    draft length 0) ``repeats`` times each, taking turns, on one embedded engine; returns the results."""
    words = list(words)
    if _flag(words, "--max-tokens") is None:
        words += ["--max-tokens", str(max_tokens)]
    models = list(models or [DEFAULT_MODEL])
    draft = _flag(words, "--draft")
    if draft and draft not in models:
        models.append(draft)
    path = resolve_inferlet(inferlet)
    if control == "draft-length-0":
        control_path, control_words = path, _without(words, "--draft-length") + ["--draft-length", "0"]
    else:
        control_path, control_words = resolve_inferlet("text-completion"), _text_completion_words(words)
    spec_words = words + (["--timing"] if timing else [])

    def go(p: Path, ws: list[str], prompt: str) -> dict:
        out = run_inferlet(p, eng.address, ["--prompt", prompt, "--stream", "false"] + ws, stdout=subprocess.DEVNULL)
        if not out["ok"]:
            raise LaunchError(f"{p.stem}: {out.get('error')}")
        return out["result"]

    results = []
    with EmbeddedEngine(models, engine_args or [], die_with_parent=True) as eng:
        go(resolve_inferlet("text-completion"), ["--max-tokens", "4"], prompts[0])  # warm-up: first-call costs
        setup = served_setup(models, engine_args or [])
        for prompt in prompts:
            specs, bases = [], []
            for i in range(repeats):
                turns = [(specs, path, spec_words), (bases, control_path, control_words)]
                for runs, p, ws in turns if i % 2 == 0 else turns[::-1]:
                    runs.append(go(p, ws, prompt))
            results.append(
                {
                    "inferlet": path.stem,
                    "models": models,
                    **setup,
                    "spec_runs": specs,
                    "base_runs": bases,
                    "control": control,
                    "greedy": float(_flag(words, "--temperature") or 0) == 0,
                }
            )
    return results


def _without(words: list[str], name: str) -> list[str]:
    """``words`` less the flag ``name`` and its value."""
    out, i = [], 0
    while i < len(words):
        if words[i] == name:
            i += 2
            continue
        if not words[i].startswith(name + "="):
            out.append(words[i])
        i += 1
    return out


def _text_completion_words(words: list[str]) -> list[str]:
    """The inferlet's words that text-completion takes (sampler and limits), dropping policy flags."""
    keep = {"--max-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--stop"}
    out, i = [], 0
    while i < len(words):
        w = words[i]
        name = w.split("=", 1)[0]
        takes_value = "=" not in w and i + 1 < len(words) and not words[i + 1].startswith("--")
        if name in keep or name == "--chat":  # a bare --chat takes no value
            out += words[i : i + (2 if takes_value else 1)]
        i += 2 if takes_value else 1
    return out


def _rate(result: dict) -> float:
    return result["stats"].get("decode_tokens_per_s", 0.0)


def summary(m: dict) -> dict:
    specs, bases = m["spec_runs"], m["base_runs"]
    spec, base = specs[0], bases[0]  # counters and tokens: the first run's (greedy runs repeat them)
    s = spec["stats"]
    rate, base_rate = statistics.median(map(_rate, specs)), statistics.median(map(_rate, bases))
    ratios = [_rate(a) / _rate(b) for a, b in zip(specs, bases, strict=True) if _rate(b)]
    control = m.get("control", "text-completion")
    ref = "text_completion" if control == "text-completion" else "control"  # names of the reference's figures
    out = {
        "inferlet": m["inferlet"],
        "weights": m["weights"],
        "threads": m["threads"],
        "decode_tokens_per_s": round(rate, 2),
        f"{ref}_tokens_per_s": round(base_rate, 2),
        "speed_ratio": round(statistics.median(ratios), 3) if ratios else None,
        "generated_tokens": len(spec["token_ids"]),
        "rounds": s.get("rounds"),
        "acceptance": round(s.get("acceptance", 0.0), 3),
        "acceptance_per_position": [round(a, 3) for a in s.get("acceptance_per_position", [])],
        "acceptance_given_kept": [round(a, 3) for a in s.get("acceptance_given_kept", [])],
        "rejecting_round_share": round(s.get("rejecting_round_share", 0.0), 3),
        "accepted_depth": round(s.get("accepted_depth", 0.0), 3),  # drafts kept per round (a tree: path depth)
        "rows_per_round": round(s.get("rows_per_round", 0.0), 2),
        "tree_rounds": s.get("tree_rounds", 0),
        "skipped": s.get("skipped", {}),
        "prefill_ms": s.get("prefill_ms"),
        "digest": digest(spec["token_ids"]),
        f"{ref}_digest": digest(base["token_ids"]),
        "greedy_match": all(r["token_ids"] == base["token_ids"] for r in specs + bases) if m["greedy"] else None,
    }
    if len(specs) > 1:
        out["repeats"] = len(specs)
        out["speed_ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None
    if s.get("replayed_rows"):  # a model with recurrent state: rows its rejecting rounds replayed
        out["replayed_rows"] = s["replayed_rows"]
    if "round_ms" in s and s["round_ms"]:
        out["round_ms_mean"] = round(statistics.fmean(s["round_ms"]), 2)
        out["round_ms_median"] = round(statistics.median(s["round_ms"]), 2)
        out["draft_ms_mean"] = round(statistics.fmean(s["draft_ms"]), 2) if s.get("draft_ms") else 0.0
        if "overhead_ms" in s:  # the adaptive planner's estimate of what a round costs past its pass and drafts
            out["round_overhead_ms"] = s["overhead_ms"]
        out[f"{ref}_ms_per_token"] = round(1e3 / base_rate, 2) if base_rate else None
    return out


def _cell(key: str, value: object) -> str:
    if key == "greedy_match" and value is None:
        return "n/a (sampled)"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def print_table(rows: list[dict]) -> None:
    """One column per prompt."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"speculation: {rows[0]['inferlet']}", show_header=True)
    table.add_column("measure")
    for row in rows:
        table.add_column(str(row["prompt"]) if len(rows) > 1 else "value", overflow="fold")
    skip = {"inferlet", "prompt"} if len(rows) > 1 else {"inferlet"}  # several: the prompts head the columns
    for key in [k for k in dict.fromkeys(k for row in rows for k in row) if k not in skip]:
        table.add_row(key.replace("_", " "), *(_cell(key, row.get(key, "")) for row in rows))
    Console().print(table)


def _speculation(args: argparse.Namespace) -> int:
    if args.workload:
        from .bench_workload import workload_command

        return workload_command(args, served_setup)
    if not args.inferlet:
        print("error: --inferlet is needed (or --workload)", file=sys.stderr)
        return 2
    try:
        named = expand_prompts(args.prompt or ["repetitive"])
        names = [name for name, _ in named]
        ms = measure_prompts(
            args.inferlet,
            [text for _, text in named],
            args.inferlet_args + (["--tree", args.tree] if args.tree else []),
            args.max_tokens,
            args.timing,
            args.model,
            args.engine_arg,
            args.control,
            max(1, args.repeats),
        )
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = [{"prompt": name, "control": args.control, **summary(m)} for name, m in zip(names, ms, strict=True)]
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print_table(rows)
    return 0
