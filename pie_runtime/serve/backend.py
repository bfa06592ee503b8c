"""What the HTTP server stands on: the engine process, the inferlet host pool and the server's own engine
connection (``hello`` for the model's facts, ``tokenizer``, ``stats`` for /metrics).

``Backend.start()`` runs in the background after the listener binds, so ``/health`` answers 503 while the
model loads; ``close()`` drains the pool, closes it (no host outlives it) and stops the engine.

Once up, a watcher waits on the engine process. When it dies (state ``restarting``) the runs in flight fail at
once with ``engine_lost`` (503), the hosts and the server's connection go with it, and a new engine, connection
and pools are brought up as the ``RestartPolicy`` allows (``engine_life.py``); past it the state is ``failed``.

With uploads allowed (``Uploads``), each key's uploaded files run in a pool of that key's own, in hosts inside
the OS sandbox (sandbox.py, tenants.py), which reach the engine through an ``ipc://`` listener of their key's
own in the sandbox's private folder (``--tenant-listen``: one engine identity a key, engine/identities.py);
those pools start on a key's first run and go with the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from inferlet.client import Client
from inferlet.tokenizer import Tokenizer

from ..launcher import EmbeddedEngine
from ..protocol.messages import PROTOCOL_VERSION, ModelInfo
from .engine_life import EngineExit, EngineState, EngineStatus, RestartPolicy, Restarts
from .host_pool import HostPool, RunFailed
from .limits import HostLimits
from .metrics import ClusterCounts
from .sandbox import Sandbox
from .tenants import UploadHosts

log = logging.getLogger("pie.serve")

State = Literal["starting", "ready", "restarting", "draining", "failed"]


@dataclass
class Uploads:
    """Where uploaded inferlets are written (a folder per key), the limits of the hosts that run them, the
    sandbox they run in and the keys that may upload (each one engine identity: a tenant listener of its own)."""

    folder: Path
    limits: HostLimits
    sandbox: Sandbox
    keys: list[str] = field(default_factory=lambda: [""])

    def __post_init__(self) -> None:
        self.hosts = UploadHosts(self.folder, self.sandbox, self.limits, self.keys)


@dataclass
class EngineSpec:
    """How to start the engine: the models it serves (the target first, then a draft model), its flags,
    and an optional extra listener (``--listen``, tcp needs ``token``)."""

    models: list[str]
    args: list[str] = field(default_factory=list)
    listen: str | None = None
    token: str | None = None
    env: dict[str, str] | None = None


class Backend:
    def __init__(
        self,
        engine: EngineSpec,
        workers: int = 1,
        inferlet_dirs: list[Path] | None = None,
        limits: HostLimits | None = None,
        chat_template: str | None = None,
        uploads: Uploads | None = None,
        restart: RestartPolicy | None = None,
    ) -> None:
        self.spec = engine
        self.workers = workers
        self.inferlet_dirs = list(inferlet_dirs or [])
        self.limits = limits
        self.chat_template = chat_template  # overrides the model's (``--chat-template``)
        self.state: State = "starting"
        self.error: str | None = None
        self.engine: EmbeddedEngine | None = None
        self.pool: HostPool | None = None
        self.uploads = uploads
        self.info: ModelInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self._client: Client | None = None
        self._stats_request: tuple[Client, asyncio.Future[dict]] | None = None  # the stats request in flight
        self._last_stats: tuple[Client, float, dict[str, Any]] | None = None  # (its client, when, the reply)
        self.restart = restart or RestartPolicy()
        self._restarts = Restarts(self.restart)
        self.engine_status = EngineStatus()
        self._watcher: asyncio.Task | None = None
        self._starting: asyncio.Future[EmbeddedEngine] | None = None

    @property
    def model(self) -> str:
        return self.spec.models[0]

    async def start(self) -> None:
        """Starts the engine and the hosts; on failure the state is ``failed`` with the reason in ``error``.
        Once up, a watcher restarts the engine when it dies (``engine_life.py``)."""
        try:
            await self._bring_up()
            self.state = "ready"
            log.info("serving %s", self.model)
            self._watcher = asyncio.create_task(self._watch())
        except Exception as e:  # noqa: BLE001 - any failure to start is reported, never raised into uvicorn
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            self._set_engine("down")
            log.error("startup failed: %s", self.error)

    async def _bring_up(self) -> None:
        """A new engine, the server's connection to it (the model's facts, its tokenizer) and the host pools."""
        # shielded: a close() that cancels a restart mid-start waits for this engine and stops it (close())
        self._starting = asyncio.ensure_future(asyncio.to_thread(self._start_engine))
        engine = await asyncio.shield(self._starting)
        self.engine = engine
        self._set_engine("up", pid=engine.proc.pid)
        address = engine.address
        self._client = Client(address)
        hello = await self._client.request("hello", version=PROTOCOL_VERSION, client="pie-serve", token=self.spec.token)
        infos = [ModelInfo.model_validate(m) for m in hello["models"]]
        self.info = next(i for i in infos if i.name == self.model)
        tok_json = (await self._client.request("tokenizer", model=self.model))["tokenizer_json"]
        self.tokenizer = Tokenizer.for_model(tok_json, self.info, self.chat_template)
        self.pool = HostPool(
            address, self.workers, token=self.spec.token, inferlet_dirs=self.inferlet_dirs, limits=self.limits
        )
        await self.pool.start()

    def engine_health(self) -> EngineStatus | None:
        """``/health``'s ``engine`` object (None: engines are watched elsewhere, as Ray's under --engines N)."""
        return self.engine_status

    def _set_engine(self, state: EngineState, **fields: Any) -> None:
        self.engine_status = self.engine_status.model_copy(update={"state": state, "since": time.time(), **fields})

    async def _watch(self) -> None:
        """Waits for the engine to exit; unless the server is closing, fails the runs in flight with
        ``engine_lost`` and starts a new engine (the restart policy permitting)."""
        while self.engine is not None:
            code = await asyncio.to_thread(self.engine.proc.wait)
            if self.state == "draining":
                return
            end = EngineExit.of(code)
            log.error("the engine (pid %s) died: %s", self.engine.proc.pid, end.describe())
            self.state, self.error = "restarting", f"the engine {end.describe()}"
            self._set_engine("restarting", pid=None, last_exit=end)
            await self._drop(RunFailed("engine_lost", f"the engine process {end.describe()}; the server restarts it"))
            if not await self._restart():
                return

    async def _drop(self, failure: RunFailed) -> None:
        """Ends everything that stood on the dead engine: its runs (with ``failure``), hosts and connection."""
        pools = [p for p in (self.pool,) if p is not None]
        self.pool = None
        await asyncio.gather(*(p.close(kill=True, failure=failure) for p in pools))
        if self.uploads is not None:
            await self.uploads.hosts.drop(failure)
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)  # reaps it; its stderr thread ends
            if self.engine.address.startswith("ipc://"):  # a killed engine leaves its socket file behind
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.engine.address.removeprefix("ipc://"))

    async def _restart(self) -> bool:
        """Starts engines until one is up (True) or the policy allows no more (False: ``failed``)."""
        while self.state == "restarting":
            pause = self._restarts.next_pause(time.monotonic())
            if pause is None:
                why = "--no-engine-restart" if not self.restart.enabled else self._cap()
                self.state, self.error = "failed", f"{self.error}; not restarted ({why})"
                self._set_engine("down")
                log.error("%s", self.error)
                return False
            await asyncio.sleep(pause)
            if self.state != "restarting":
                return False  # the server is closing
            self._restarts.record(time.monotonic())
            self._set_engine("starting", restarts=self.engine_status.restarts + 1)
            try:
                await self._bring_up()
            except Exception as e:  # noqa: BLE001 - a failed start counts against the budget; try again
                log.error("the engine restart failed: %s", e)
                self._set_engine("restarting", last_error=f"{type(e).__name__}: {e}")
                await self._drop(RunFailed("engine_lost", "the engine restart failed"))
                continue
            self.state, self.error = "ready", None
            log.info("the engine is up again (pid %s)", self.engine_status.pid)
            return True
        return False

    def _cap(self) -> str:
        p = self.restart
        return f"{p.max_restarts} restarts within {p.window_s:g} s already"

    def _start_engine(self) -> EmbeddedEngine:
        extra = list(self.spec.args)
        if self.spec.listen:
            # the engine's one listener becomes the tcp address (argparse: the last --listen wins)
            extra += ["--listen", self.spec.listen]
        env = dict(self.spec.env or {})
        if self.spec.token:
            env["PIE_ENGINE_TOKEN"] = self.spec.token  # never on argv (`pie engine` reads it from there)
        if self.uploads is not None:  # a listener per key: the engine charges all its connections' totals together
            for key in self.uploads.keys:
                extra += ["--tenant-listen", self.uploads.sandbox.engine_address(key)]
        engine = EmbeddedEngine(self.spec.models, extra, env=env)
        if self.spec.listen:
            engine.address = self.spec.listen
        return engine

    async def stats(self) -> dict[str, Any] | None:
        """The engine's ``stats`` reply; while the engine is inside a long step (a long prefill's chunks on a
        loaded machine) and does not answer within 5 s, its last reply with ``stale_s`` (seconds since it came),
        so /metrics answers with what was last known instead of dropping the engine's series; None when the
        engine has not answered yet. One request is in flight at a time: scrapes during a long step wait on it
        instead of queueing more behind the step."""
        client = self._client
        if client is None or self.state not in ("ready", "draining"):
            return None
        if self._stats_request is None or self._stats_request[0] is not client:
            self._stats_request = (client, asyncio.ensure_future(client.request("stats")))
        request = self._stats_request[1]
        try:
            fresh = await asyncio.wait_for(asyncio.shield(request), timeout=5.0)
        except TimeoutError:
            if self._last_stats is None or self._last_stats[0] is not client:
                return None
            return {**self._last_stats[2], "stale_s": round(time.monotonic() - self._last_stats[1], 1)}
        except (OSError, RuntimeError) as e:
            log.warning("engine stats unavailable: %s", e)
            self._stats_request = None
            return None
        if self._stats_request is not None and self._stats_request[1] is request:
            self._stats_request = None
        self._last_stats = (client, time.monotonic(), fresh)
        return fresh

    async def engine_stats(self) -> dict[str, dict[str, Any]] | None:
        """For /metrics: engine name → its ``stats`` (``""``: the one engine), None when none can be had now."""
        stats = await self.stats()
        return None if stats is None else {"": stats}

    def cluster_counts(self) -> ClusterCounts | None:
        """For /metrics: the router's and the engines' counts under ``--engines N`` (None: one engine)."""
        return None

    async def close(self, drain_timeout: float) -> None:
        self.state = "draining"
        if self._watcher is not None:
            self._watcher.cancel()  # a restart under way stops; what it brought up is closed below
            await asyncio.gather(self._watcher, return_exceptions=True)
        if self._starting is not None:  # an engine a cancelled restart was starting: stopped once it is up
            started = (await asyncio.gather(self._starting, return_exceptions=True))[0]
            if isinstance(started, EmbeddedEngine) and started is not self.engine:
                await asyncio.to_thread(started.stop)
        pools = [p for p in (self.pool,) if p is not None]
        try:
            await asyncio.gather(*(p.drain(drain_timeout) for p in pools))
        finally:
            for p in pools:
                await p.close()
            if self.uploads is not None:
                await self.uploads.hosts.drop(drain_timeout=drain_timeout)
        if self._client is not None:
            self._client.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        self._set_engine("stopped", pid=None)
