"""Entry point of the `pie` console script: builds the argument parser from the subcommand modules."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines register(subparsers) and sets a `func(args) -> int` default on its parsers.
SUBCOMMANDS = ("model", "engine", "run", "serve", "drafter", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pie", description="Programmable LLM serving runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"pie_runtime.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"pie_runtime.cli.{name}":
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # words after `--` belong to the inferlet, not to us
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = parser_args = build_parser().parse_args(argv)
    parser_args.inferlet_args = extra
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
