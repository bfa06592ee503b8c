"""The engine's life under `pie serve`: what ``/health`` reports of it and when a dead engine is started again.

The server's one engine is a child process. When it dies (a crash, the OOM killer, SIGKILL) every run in
flight fails at once with 503 ``engine_lost``, and the server starts a new engine after a pause: 0.5 s, doubled
for each restart already made within the window, at most 10 s; past ``max_restarts`` restarts within
``window_s`` seconds it gives up and stays unhealthy (``failed``). ``pie serve --no-engine-restart`` gives up
at the first death. ``EngineStatus`` is what ``/health`` shows: the engine's state, its pid, since when it is in
that state, the restarts made and how the last engine ended.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from typing import Literal

from pydantic import BaseModel, Field

EngineState = Literal["starting", "up", "restarting", "down", "stopped"]


class RestartPolicy(BaseModel, frozen=True):
    """When a dead engine is started again (``enabled`` false: never)."""

    enabled: bool = True
    max_restarts: int = Field(default=5, ge=0)  # within window_s
    window_s: float = Field(default=300.0, gt=0)
    backoff_s: float = Field(default=0.5, ge=0)
    max_backoff_s: float = Field(default=10.0, ge=0)


class EngineExit(BaseModel):
    """How an engine process ended: its exit code, or the signal that killed it."""

    code: int | None = None
    signal: str | None = None
    at: float  # unix time

    @classmethod
    def of(cls, returncode: int) -> EngineExit:
        if returncode >= 0:
            return cls(code=returncode, at=time.time())
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return cls(signal=name, at=time.time())

    def describe(self) -> str:
        return f"killed by {self.signal}" if self.signal else f"exited with code {self.code}"


class EngineStatus(BaseModel):
    """``/health``'s ``engine`` object."""

    state: EngineState = "starting"
    pid: int | None = None
    since: float = Field(default_factory=time.time)  # unix time the state began
    restarts: int = 0
    last_exit: EngineExit | None = None
    last_error: str | None = None  # why the last start failed, when one did


class Restarts:
    """The restart budget: the times of the restarts made within the policy's window."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._times: deque[float] = deque()

    def next_pause(self, now: float) -> float | None:
        """Seconds to wait before the next start, or None when no restart is left (off, or the cap reached)."""
        p = self.policy
        while self._times and now - self._times[0] > p.window_s:
            self._times.popleft()
        if not p.enabled or len(self._times) >= p.max_restarts:
            return None
        return min(p.backoff_s * 2 ** len(self._times), p.max_backoff_s)

    def record(self, now: float) -> None:
        self._times.append(now)
