"""What belongs to one API key: its uploaded inferlets (and the sandboxed hosts that run them) and its runs.

Every key is a namespace. ``UploadHosts`` keeps each key's uploads in a folder of its own
(``ROOT/k-<digest>``, sandbox.key_dir) and runs them in a ``HostPool`` of its own, started on the key's first
run, whose hosts live in the OS sandbox (sandbox.py) with only that folder in view: one key's code never
shares a process, a pid namespace, a uid or a file with another key's. ``RunOwners`` remembers which key
started each run id, so a cancel by another key finds nothing (404).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from .host_pool import HostPool, RunFailed
from .limits import HostLimits
from .sandbox import Sandbox, SandboxLauncher, key_dir


class UploadHosts:
    """Each key's upload folder and, once it has run one, its sandboxed host pool."""

    def __init__(self, root: Path, sandbox: Sandbox, limits: HostLimits, keys: list[str] | None = None) -> None:
        self.root = root
        self.sandbox = sandbox
        self.limits = limits
        self.keys = set(keys if keys is not None else [""])  # the keys the engine has a tenant listener for
        self._pools: dict[str, HostPool] = {}
        self._lock = asyncio.Lock()

    def folder(self, key: str) -> Path:
        folder = self.root / key_dir(key)
        folder.mkdir(mode=0o755, parents=True, exist_ok=True)
        return folder

    def uploaded(self, key: str) -> dict[str, Path]:
        """The key's uploaded inferlets, name → file."""
        return {p.stem: p for p in sorted(self.folder(key).glob("*.py"))}

    def write(self, key: str, name: str, source: str) -> None:
        """Stores an upload atomically (a run never loads half a file), readable by the sandbox's uid."""
        folder = self.folder(key)
        tmp = folder / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(source)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / f"{name}.py")

    async def pool(self, key: str) -> HostPool:
        """The key's host pool, started (in its sandbox) on first use."""
        async with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                if key not in self.keys:  # no engine listener of its own: it would share another's identity
                    raise RunFailed("host_crashed", "this key has no engine listener (keys are read at start)")
                control = self.sandbox.control_dir(key)
                control.mkdir(mode=0o700, parents=True, exist_ok=True)
                folder = self.folder(key)
                pool = HostPool(
                    self.sandbox.engine_address(key),
                    1,
                    inferlet_dirs=[folder],
                    limits=self.limits,
                    launcher=SandboxLauncher(self.sandbox, key, folder),
                    control_dir=control,
                    start_timeout_s=60.0,
                )
                try:
                    await pool.start()
                except RuntimeError as e:
                    raise RunFailed("host_crashed", f"the upload sandbox did not start: {e}") from None
                self._pools[key] = pool
            return pool

    def pools(self) -> list[HostPool]:
        return list(self._pools.values())

    async def drop(self, failure: RunFailed | None = None, drain_timeout: float | None = None) -> None:
        """Stops every key's hosts (they are started again on the next run): at a server's close (drained
        first) or with ``failure`` when the engine they stood on died."""
        async with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        if drain_timeout is not None:
            await asyncio.gather(*(p.drain(drain_timeout) for p in pools))
        await asyncio.gather(*(p.close(kill=failure is not None, failure=failure) for p in pools))


class RunOwners:
    """Which key started each live run id."""

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}

    def add(self, run_id: str, key: str) -> None:
        self._owner[run_id] = key

    def discard(self, run_id: str) -> None:
        self._owner.pop(run_id, None)

    def owns(self, key: str, run_id: str) -> bool:
        return self._owner.get(run_id) == key
