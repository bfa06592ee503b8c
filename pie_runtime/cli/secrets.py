"""Secrets on the command line: API keys and the engine's token come from a file or the environment.

A process's argv is readable by every local user (``ps``, ``/proc/PID/cmdline``), so a flag that takes a
secret also takes ``@FILE`` (the secret is the file's text, stripped; for ``--api-key`` one key a line) and
falls back to an environment variable. A literal secret on argv still works, with a warning on stderr.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _warn(flag: str, env: str) -> None:
    print(
        f"warning: {flag} VALUE puts a secret on the command line, where every local user can read it; "
        f"use {flag} @FILE or ${env}",
        file=sys.stderr,
    )


def _read(value: str, flag: str) -> str:
    path = Path(value[1:]).expanduser()
    try:
        return path.read_text().strip()
    except OSError as e:
        raise ValueError(f"{flag} {value}: cannot read the file ({e.strerror})") from None


def secret(value: str | None, flag: str, env: str) -> str | None:
    """One secret: ``@FILE``'s text, a literal (warned about), else ``$env`` (None when unset or empty)."""
    if value is None:
        return os.environ.get(env) or None
    if value.startswith("@"):
        text = _read(value, flag)
        if not text:
            raise ValueError(f"{flag} {value}: the file is empty")
        return text
    _warn(flag, env)
    return value


def secret_list(values: list[str], flag: str, env: str) -> list[str]:
    """Several secrets: each value a literal (warned about) or ``@FILE`` of one a line; plus ``$env`` (one a
    line or comma-separated)."""
    out: list[str] = []
    for value in values:
        if value.startswith("@"):
            out += [line.strip() for line in _read(value, flag).splitlines() if line.strip()]
        else:
            _warn(flag, env)
            out.append(value)
    extra = os.environ.get(env, "")
    out += [k.strip() for k in extra.replace(",", "\n").splitlines() if k.strip()]
    return list(dict.fromkeys(out))
