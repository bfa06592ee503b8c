"""Child processes in tests: read what they say without ever waiting forever."""

from __future__ import annotations

import select
import subprocess

import pytest


def expect_line(proc: subprocess.Popen, expected: str, timeout: float = 180) -> None:
    """Waits for the child's next stdout line and checks it; a silent or dead child fails the test (and is
    killed) instead of hanging the suite."""
    assert proc.stdout is not None, "the child needs stdout=subprocess.PIPE"
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().strip() if ready else None
    if line != expected:
        proc.kill()
        pytest.fail(f"child said {line!r} (expected {expected!r}; exit code {proc.poll()})")
