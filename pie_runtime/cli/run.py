"""`pie run NAME_OR_FILE [--model NAME] [--engine ADDR] [--json] -- ARGS`: run one inferlet.

Without --engine an engine is started on the model (the default one, imported on first use) and stopped
afterwards: the embedded default."""

from __future__ import annotations

import json
import sys

from .engine import add_engine_options, weights_words


def register(sub) -> None:
    p = sub.add_parser("run", help="run a shipped inferlet by name, or a .py file")
    p.add_argument("inferlet", help="a shipped inferlet's name or a path to a .py file")
    p.add_argument("--model", action="append", default=None, help="model(s) for the embedded engine")
    p.add_argument("--engine", default=None, help="address of a running engine")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    add_engine_options(p)
    p.set_defaults(func=run)


def engine_args(args) -> list[str]:
    out = [
        "--device",
        args.device,
        *weights_words(args),
        "--page-size",
        str(args.page_size),
        "--max-batch-tokens",
        str(args.max_batch_tokens),
    ]
    out += ["--kv-pages", str(args.kv_pages)] if args.kv_pages else ["--kv-memory", str(args.kv_memory)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    out += ["--compile" if args.compile else "--no-compile"]
    out += [] if args.prefix_cache else ["--no-prefix-cache"]
    out += ["--state-slots", str(args.state_slots)]
    out += ["--recurrent-fold", getattr(args, "recurrent_fold", "per-row")]
    out += ["--per-row-states", str(getattr(args, "per_row_states", 8))]
    if getattr(args, "tensor_parallel", 1) > 1:
        out += ["--tensor-parallel", str(args.tensor_parallel)]
    out += ["--pass-cost-rows", str(args.pass_cost_rows), "--pass-cost-cache", args.pass_cost_cache]
    out += ["--program-memory", str(args.program_memory)]
    out += [] if args.prepack else ["--no-prepack"]
    return out


def run(args) -> int:
    from ..launcher import EmbeddedEngine, LaunchError, resolve_inferlet, run_inferlet

    try:
        path = resolve_inferlet(args.inferlet)
        if args.engine:
            outcome = run_inferlet(path, args.engine, args.inferlet_args)
        else:
            with EmbeddedEngine(args.model, engine_args(args), die_with_parent=True) as engine:
                outcome = run_inferlet(path, engine.address, args.inferlet_args)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    if not outcome["ok"]:
        print(f"error: {outcome['error']}", file=sys.stderr)
        return 1
    result = outcome["result"]
    if args.json:
        print(json.dumps(result))
    elif isinstance(result, dict):
        for key, value in result.items():
            if key not in ("text", "token_ids"):
                print(f"{key}: {json.dumps(value)}", file=sys.stderr)
    elif result is not None:
        print(json.dumps(result))
    return 0
