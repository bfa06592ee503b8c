#!/usr/bin/env bash
# The lint step, run by scripts/test.sh before the tests: ruff's rules, ruff's formatting and pyright (basic mode),
# all configured in pyproject.toml, and the docs site's strict build (mkdocs.yml: a broken link, snippet or API
# reference fails it); installed by `bash scripts/setup.sh --test`. Fails on any finding.
#   bash scripts/lint.sh         # check only
#   bash scripts/lint.sh --fix   # first apply ruff's safe fixes and its formatting, then check
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fix" ]; then
  .venv/bin/ruff check --fix --quiet . || true
  .venv/bin/ruff format --quiet .
fi
failed=()
.venv/bin/ruff check . || failed+=("ruff check")
.venv/bin/ruff format --check . || failed+=("ruff format --check (bash scripts/lint.sh --fix formats)")
# the pin is deliberate: no "a newer pyright exists" check against the package index
PYRIGHT_PYTHON_IGNORE_WARNINGS=1 .venv/bin/pyright || failed+=("pyright")
site=$(mktemp -d)  # the built site is thrown away: only the check matters
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site" || failed+=("mkdocs build --strict (the docs site)")
rm -rf "$site"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'lint failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
