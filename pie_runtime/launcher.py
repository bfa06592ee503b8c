"""Runs inferlets as child processes, and starts an embedded engine when none is given.

An inferlet never shares a process with the engine: a crash, a loop or a memory blow-up ends the child,
and the engine reclaims what it held when its socket closes.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED = REPO_ROOT / "inferlets"


class LaunchError(RuntimeError):
    pass


def resolve_inferlet(name_or_file: str) -> Path:
    """A shipped inferlet's name (``text-completion``) or a path to a user's ``.py`` file."""
    path = Path(name_or_file)
    if path.suffix == ".py":
        if not path.is_file():
            raise LaunchError(f"no inferlet file {path}")
        return path.resolve()
    shipped = SHIPPED / f"{name_or_file}.py"
    if not shipped.is_file():
        raise LaunchError(f"no shipped inferlet {name_or_file!r}; shipped: {', '.join(shipped_inferlets())}")
    return shipped


def shipped_inferlets() -> list[str]:
    """The names of the inferlets in the repository's inferlets/ folder."""
    return sorted(p.stem for p in SHIPPED.glob("*.py") if not p.stem.startswith("_"))


class EmbeddedEngine:
    """An engine subprocess on a fresh ipc:// address, up until ``stop()`` (or the with-block ends)."""

    def __init__(
        self,
        models: list[str] | None = None,
        extra_args: list[str] | None = None,
        timeout: float = 300,
        env: dict[str, str] | None = None,
        die_with_parent: bool = False,
    ):
        """``die_with_parent``: the kernel kills the engine when the thread that started it dies (a Ray actor
        killed by SIGKILL leaves no engine behind; nor does a `pie run` or `pie bench` stopped by a signal that
        skips its cleanup). Only for an engine started on a thread that lives as long as it should."""
        self.address = f"ipc://{tempfile.gettempdir()}/pie-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
        cmd = [sys.executable, "-m", "pie_runtime.cli.main", "engine", "--listen", self.address]
        for m in models or []:
            cmd += ["--model", m]
        cmd += extra_args or []
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
        self._stderr: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        deadline = time.monotonic() + timeout
        line = "x"
        assert self.proc.stdout is not None  # PIPE
        while line and "engine ready" not in line and time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # "pie engine ready on ..." or EOF when it failed
        if "engine ready" not in line:
            self.proc.wait(timeout=10)
            tail = "".join(self._stderr[-20:]).strip()
            last = tail.splitlines()[-1] if tail else "no output"
            hint = (
                "" if "error: " in last else " (PIE_ENGINE_LOG=1 prints its whole log)"
            )  # its own errors say what to do
            raise LaunchError(f"the engine did not start: {last.removeprefix('error: ')}{hint}")

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None  # PIPE
        for line in self.proc.stderr:
            self._stderr.append(line)
            if os.environ.get("PIE_ENGINE_LOG"):
                sys.stderr.write(line)

    @property
    def log(self) -> str:
        return "".join(self._stderr)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _die_with_parent() -> None:
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def run_inferlet(
    path: Path,
    engine: str,
    words: list[str],
    stdout=None,
    timeout: float | None = None,
    on_output: Callable[[bytes], None] | None = None,
    token: str | None = None,
) -> dict:
    """Runs one inferlet against ``engine``; returns ``{"ok": True, "result": ...}`` or ``{"ok": False, ...}``.
    The child's streamed text goes to ``stdout`` (ours by default), or with ``on_output`` to that function,
    chunk by chunk as the child writes it. ``token``: the engine's (tcp://), handed over in ``$PIE_TOKEN``."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "inferlet",
            "--engine",
            engine,
            "--result",
            str(result_file),
            str(path),
            "--",
            *words,
        ]
        env = {**os.environ, "PIE_TOKEN": token} if token else None  # never on argv
        if on_output is None:
            out = stdout if stdout is not None else None
            code = subprocess.run(cmd, stdout=out, timeout=timeout, env=env).returncode
        else:
            code = _run_piped(cmd, on_output, timeout, env)
        if result_file.exists():
            return json.loads(result_file.read_text())
        return {"ok": False, "error": f"the inferlet process died ({_exit_words(code)})"}


def _run_piped(
    cmd: list[str], on_output: Callable[[bytes], None], timeout: float | None, env: dict[str, str] | None = None
) -> int:
    """Runs ``cmd`` handing its stdout to ``on_output`` as it comes; its exit code."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env) as proc:
        assert proc.stdout is not None  # PIPE
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = proc.stdout.fileno()
        while True:
            if deadline is not None and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                proc.kill()
                raise subprocess.TimeoutExpired(cmd, timeout or 0)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            on_output(chunk)
        return proc.wait()


def _exit_words(code: int) -> str:
    """An exit status as a person reads it: ``exit 1``, or the signal that killed the process and what that
    usually means."""
    if code >= 0:
        return f"exit {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    hint = {"SIGKILL": ": killed, often by the kernel when memory ran out", "SIGSEGV": ": a crash in native code"}
    return f"killed by {name}{hint.get(name, '')}"
