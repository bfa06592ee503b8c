"""`pie run --engine tcp://... --token`: the engine's token from ``@FILE``, a literal (warned about) or ``$PIE_TOKEN``,
handed to the inferlet process in its environment; no token, a wrong one or a token without --engine are one
line on stderr naming what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pie_runtime.launcher import EmbeddedEngine
from tests.conftest import REPO, TINY
from tests.serve.server_proc import free_port

pytestmark = pytest.mark.e2e
TOKEN = "sesame-0123456789"


@pytest.fixture(scope="module")
def tcp_engine(pie_home):
    address = f"tcp://127.0.0.1:{free_port()}"
    args = ["--kv-pages", "64", "--weights", "fp32", "--no-compile", "--pass-cost-rows", "0", "--listen", address]
    eng = EmbeddedEngine([TINY], args, env={"PIE_HOME": str(pie_home), "PIE_ENGINE_TOKEN": TOKEN})
    yield address
    eng.stop()


def pie_run(pie_home, *words: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pie_runtime.cli.main", "run", "text-completion", *words]
    cmd += ["--", "--prompt", "Hello", "--max-tokens", "3", "--temperature", "0"]
    base = {k: v for k, v in os.environ.items() if k != "PIE_TOKEN"}
    full_env = {**base, "PIE_HOME": str(pie_home), **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=REPO, timeout=300)


def tokens(done: subprocess.CompletedProcess) -> list[int]:
    return json.loads(done.stdout.splitlines()[-1])["token_ids"]


def test_token_from_file_environment_or_literal(pie_home, tcp_engine, tmp_path):
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    by_file = pie_run(pie_home, "--engine", tcp_engine, "--token", f"@{secret}", "--json")
    assert by_file.returncode == 0, by_file.stderr
    assert "warning" not in by_file.stderr and TOKEN not in by_file.stdout + by_file.stderr
    by_env = pie_run(pie_home, "--engine", tcp_engine, "--json", env={"PIE_TOKEN": TOKEN})
    assert by_env.returncode == 0, by_env.stderr
    assert tokens(by_env) == tokens(by_file) and len(tokens(by_file)) == 3  # the same greedy result
    literal = pie_run(pie_home, "--engine", tcp_engine, "--token", TOKEN)
    assert literal.returncode == 0 and "puts a secret on the command line" in literal.stderr


def test_missing_or_wrong_token_is_one_line(pie_home, tcp_engine, tmp_path):
    none = pie_run(pie_home, "--engine", tcp_engine)
    assert none.returncode == 2 and "--token @FILE or $PIE_TOKEN" in none.stderr, none.stderr
    wrong = pie_run(pie_home, "--engine", tcp_engine, env={"PIE_TOKEN": "not-it"})
    assert wrong.returncode != 0 and "token" in wrong.stderr.lower(), wrong.stderr
    assert "Traceback" not in wrong.stderr
    stray = pie_run(pie_home, "--token", "@/nonexistent")
    assert stray.returncode == 2 and "--token is for --engine" in stray.stderr
    unreadable = pie_run(pie_home, "--engine", tcp_engine, "--token", f"@{tmp_path / 'missing'}")
    assert unreadable.returncode == 2 and "cannot read the file" in unreadable.stderr
