"""What the HTTP server stands on: the engine process, the inferlet host pool and the server's own engine
connection (``hello`` for the model's facts, ``tokenizer``, ``stats`` for /metrics).

``Backend.start()`` runs in the background after the listener binds, so ``/health`` answers 503 while the
model loads; ``close()`` drains the pool, closes it (no host outlives it) and stops the engine.

With uploads allowed (``Uploads``), a second pool runs the uploaded files, from a folder of the server's own,
in hosts under resource limits and without the server's environment (no keys, no tokens but the engine's).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from inferlet.client import Client
from inferlet.tokenizer import Tokenizer

from ..launcher import EmbeddedEngine
from ..protocol.messages import PROTOCOL_VERSION, ModelInfo
from .host_pool import HostPool
from .limits import HostLimits
from .metrics import ClusterCounts

log = logging.getLogger("pie.serve")

State = Literal["starting", "ready", "draining", "failed"]


@dataclass
class Uploads:
    """Where uploaded inferlets are written, and the limits of the hosts that run them."""

    folder: Path
    limits: HostLimits


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
        self.upload_pool: HostPool | None = None
        self.info: ModelInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self._client: Client | None = None

    @property
    def model(self) -> str:
        return self.spec.models[0]

    async def start(self) -> None:
        """Starts the engine and the hosts; on failure the state is ``failed`` with the reason in ``error``."""
        try:
            self.engine = await asyncio.to_thread(self._start_engine)
            address = self.engine.address
            self._client = Client(address)
            hello = await self._client.request(
                "hello", version=PROTOCOL_VERSION, client="pie-serve", token=self.spec.token
            )
            infos = [ModelInfo.model_validate(m) for m in hello["models"]]
            self.info = next(i for i in infos if i.name == self.model)
            tok_json = (await self._client.request("tokenizer", model=self.model))["tokenizer_json"]
            self.tokenizer = Tokenizer(
                tok_json,
                self.info.eos_token_ids,
                self.info.bos_token_id,
                self.chat_template or self.info.chat_template,
            )
            self.pool = HostPool(
                address, self.workers, token=self.spec.token, inferlet_dirs=self.inferlet_dirs, limits=self.limits
            )
            await self.pool.start()
            if self.uploads is not None:
                self.uploads.folder.mkdir(parents=True, exist_ok=True)
                self.upload_pool = HostPool(
                    address, 1, token=self.spec.token, inferlet_dirs=[self.uploads.folder], limits=self.uploads.limits
                )
                await self.upload_pool.start()
            self.state = "ready"
            log.info("serving %s", self.model)
        except Exception as e:  # noqa: BLE001 - any failure to start is reported, never raised into uvicorn
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            log.error("startup failed: %s", self.error)

    def _start_engine(self) -> EmbeddedEngine:
        extra = list(self.spec.args)
        if self.spec.listen:
            # the engine's one listener becomes the tcp address (argparse: the last --listen wins)
            extra += ["--listen", self.spec.listen]
        if self.spec.token:
            extra += ["--token", self.spec.token]
        engine = EmbeddedEngine(self.spec.models, extra, env=self.spec.env)
        if self.spec.listen:
            engine.address = self.spec.listen
        return engine

    async def stats(self) -> dict[str, Any] | None:
        """The engine's ``stats`` reply, or None when it cannot be had now."""
        if self._client is None or self.state not in ("ready", "draining"):
            return None
        try:
            return await asyncio.wait_for(self._client.request("stats"), timeout=5.0)
        except (TimeoutError, OSError, RuntimeError) as e:
            log.warning("engine stats unavailable: %s", e)
            return None

    async def engine_stats(self) -> dict[str, dict[str, Any]] | None:
        """For /metrics: engine name → its ``stats`` (``""``: the one engine), None when none can be had now."""
        stats = await self.stats()
        return None if stats is None else {"": stats}

    def cluster_counts(self) -> ClusterCounts | None:
        """For /metrics: the router's and the engines' counts under ``--engines N`` (None: one engine)."""
        return None

    async def close(self, drain_timeout: float) -> None:
        self.state = "draining"
        pools = [p for p in (self.pool, self.upload_pool) if p is not None]
        try:
            await asyncio.gather(*(p.drain(drain_timeout) for p in pools))
        finally:
            for p in pools:
                await p.close()
        if self._client is not None:
            self._client.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
