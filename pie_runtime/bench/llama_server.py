"""The servers `pie bench serve` starts, as children on free ports: ``ServerChild`` (any HTTP server with a
``/health``), and llama-server (``llama_server_env`` builds it) on the packaged GGUF, the other side of
`pie bench serve --against llama-server`."""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def term_with_parent() -> None:
    """A ``preexec_fn``: the kernel sends the child SIGTERM when the bench dies (a killed bench leaves no
    server, nor through the server's clean exit its engine, behind)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def server_words(parallel: int, threads: int, context_per_slot: int = 1024) -> list[str]:
    """llama-server's load options: ``parallel`` slots sharing a context of ``context_per_slot`` tokens each
    (``--parallel 32 -c 32768`` at 32), ``threads`` threads for generation and for a batch (``-tb`` follows
    ``-t``)."""
    return ["--parallel", str(parallel), "-c", str(parallel * context_per_slot), "-t", str(threads)]


class ServerChild:
    """An HTTP server child (its output in a temporary file) on ``base``, ready once its ``/health`` answers
    200, up until ``stop()``: `pie serve` or llama-server, for the bench."""

    def __init__(self, name: str, base: str, cmd: list[str], timeout: float = 900) -> None:
        import httpx

        self.name, self.base = name, base
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - open for the child's life, closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=term_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{name} exited {self.proc.returncode}: {self.log.read()[-1500:]}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} did not become ready in {timeout:g} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def llama_server(binary: Path, gguf: Path, words: list[str]) -> ServerChild:
    """llama-server on ``gguf`` with ``words`` (:func:`server_words`) on a free port, started and ready."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--no-webui", *words]
    return ServerChild("llama-server", f"http://127.0.0.1:{port}", cmd, timeout=300)
