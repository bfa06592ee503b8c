"""`--thread-wait`: how the engine's OpenMP threads wait for work, set before torch loads its runtime."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pie_runtime.cli.main import build_parser
from pie_runtime.cli.run import engine_args

PROBE = "from pie_runtime.cli.engine import apply_thread_wait as a; a({!r}); import torch; torch.ones(1)"


def runtime_settings(wait: str, **env: str) -> str:
    """What libgomp reports it loaded with (OMP_DISPLAY_ENV) in a fresh process that applied ``wait``."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(wait)],
        env={**clean, "OMP_DISPLAY_ENV": "VERBOSE", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stderr


@pytest.mark.parametrize(("wait", "env", "spin"), [("spin", {}, "300000"), ("passive", {}, "0"),
                                                    ("short", {}, "30000"),
                                                    ("short", {"OMP_WAIT_POLICY": "PASSIVE"}, "30000"),
                                                    ("spin", {"OMP_WAIT_POLICY": "PASSIVE"}, "0"),
                                                    ("passive", {"GOMP_SPINCOUNT": "5000"}, "0")])  # fmt: skip
def test_passive_threads_never_spin_and_spin_keeps_the_runtime_default(wait, env, spin):
    assert f"GOMP_SPINCOUNT = '{spin}'" in runtime_settings(wait, **env)


def test_pie_run_and_serve_pass_the_choice_to_their_engine():
    for command in ("run", "serve"):
        words = [command, "text-completion"] if command == "run" else [command]
        args = build_parser().parse_args([*words, "--thread-wait", "passive"])
        argv = engine_args(args)
        assert argv[argv.index("--thread-wait") + 1] == "passive"
        assert "spin" in engine_args(build_parser().parse_args(words))
