#!/usr/bin/env bash
# Sets up (see setup.sh), lints (see lint.sh) and runs the test suite; arguments go to pytest.
#   bash scripts/test.sh                 # everything (what CI runs)
#   bash scripts/test.sh -m "not e2e"    # the fast suite: no engine or inferlet processes, about a minute
# The slowest 25 tests are listed at the end (where the suite's time goes).
# PIE_SKIP_LINT=1 skips the lint step (for a quick run in a tree being edited; CI never sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
if [ "${PIE_SKIP_LINT:-0}" != "1" ]; then
  bash scripts/lint.sh
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
