"""``python -m inferlet --engine ADDR [--result FILE] FILE -- ARGS``: run one inferlet (the launcher's child)."""

import argparse
import os
import sys

from .runtime import run_file


def main() -> int:
    argv = sys.argv[1:]
    words: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, words = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m inferlet")
    p.add_argument("--engine", required=True)
    p.add_argument("--result", default=None)
    p.add_argument("file")
    a = p.parse_args(argv)
    return run_file(a.file, a.engine, words, a.result, os.environ.get("PIE_TOKEN"))


if __name__ == "__main__":
    sys.exit(main())
