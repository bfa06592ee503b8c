"""One build or install step of a bench peer's environment (llama-server's build, OpenVINO GenAI's install and
export), its output appended to the environment's log; a failure is raised as the peer's own "unavailable"
error, whose one-line message names the step, the log's last line and the log, for the bench's "skipped" line.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def run_step(
    cmd: list[str], log: Path, what: str, error: type[Exception], timeout: float, cwd: Path | None = None
) -> None:
    """Runs ``cmd`` (in ``cwd``) with its output appended to ``log``; ``error`` naming ``what`` when it fails."""
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, timeout=timeout)
        except FileNotFoundError as e:
            raise error(f"{what}: {e.filename} not found") from None
        except subprocess.TimeoutExpired:
            raise error(f"{what} ran past {timeout:.0f} s (log {log})") from None
    if done.returncode != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        last = tail[0].strip()[:200] if tail else "no output"
        raise error(f"{what} failed ({last}; log {log})")
