"""``ClusterBackend``: ``pie serve --engines N``'s backend. It connects to Ray (``--ray-address``, or a
local instance it starts), creates the router actor and N engine actors (``ray_actors.py``), and serves
through a ``ClusterPool`` (``pool.py``) in place of one host pool, whose hosts run on their engines' nodes
(``host_actor.py``). The HTTP app sees the same ``Backend``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray

from inferlet.client import Client
from inferlet.tokenizer import Tokenizer

from ..protocol import PieError
from ..protocol.messages import PROTOCOL_VERSION, ModelInfo
from ..serve.backend import Backend, EngineSpec
from ..serve.metrics import ClusterCounts
from .pool import ClusterPool, EngineSlot
from .ray_actors import EngineInfo, engine_actor, router_actor
from .router import RouterConfig

log = logging.getLogger("pie.cluster")

_ENV_PASSED = ("PIE_HOME", "PIE_ENGINE_LOG")  # what an engine on another node needs of ours


def init_ray(address: str | None, num_cpus: int | None = None, object_store_mib: int = 128) -> None:
    """Connects to a running cluster (``auto`` or ``HOST:PORT``), or starts a small local instance."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(
            num_cpus=num_cpus or os.cpu_count() or 1,
            include_dashboard=False,
            object_store_memory=object_store_mib << 20,
            log_to_driver=False,
        )


class ClusterBackend(Backend):
    def __init__(
        self,
        engine: EngineSpec,
        engines: int,
        ray_address: str | None = None,
        router: RouterConfig | None = None,
        engine_cpus: float = 1.0,
        max_restarts: int = -1,
        pool_options: dict[str, Any] | None = None,
        tcp: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """``tcp``: engines and the hosts' control socket on ``tcp://`` with tokens, as on a cluster of several
        machines (default: when ``ray_address`` is given; else ``ipc://``, all on this machine)."""
        super().__init__(engine, **kwargs)
        if engines < 1:
            raise ValueError("--engines must be at least 1")
        self.engines = engines
        self.ray_address = ray_address
        self.router_config = router or RouterConfig()
        self.engine_cpus = engine_cpus
        self.max_restarts = max_restarts
        self.pool_options = dict(pool_options or {})
        self.tcp = ray_address is not None if tcp is None else tcp
        self.cluster: ClusterPool | None = None
        self._actors: list[Any] = []
        self._owns_ray = False
        self._last_stats: dict[str, dict[str, Any]] = {}
        self._stats_clients: dict[str, tuple[str, Client]] = {}  # engine → (its address, a connection to it)

    async def start(self) -> None:
        try:
            self._owns_ray = not ray.is_initialized() and not self.ray_address
            cpus = max(int(self.engines * self.engine_cpus + 0.999), os.cpu_count() or 1)
            await asyncio.to_thread(init_ray, self.ray_address, cpus)
            env = {k: os.environ[k] for k in _ENV_PASSED if k in os.environ} | (self.spec.env or {})
            tcp = self.tcp  # another node may host an engine: tcp with a token
            self._actors = [
                engine_actor(
                    f"engine-{i}",
                    self.spec.models,
                    self.spec.args,
                    env,
                    tcp=tcp,
                    num_cpus=self.engine_cpus,
                    max_restarts=self.max_restarts,
                )
                for i in range(self.engines)
            ]
            infos: list[EngineInfo] = await asyncio.gather(*(a.info.remote() for a in self._actors))
            first = infos[0]
            self._client = Client(first.address)
            hello = await self._client.request("hello", version=PROTOCOL_VERSION, client="pie-serve", token=first.token)
            self.info = next(ModelInfo.model_validate(m) for m in hello["models"] if m["name"] == self.model)
            tok_json = (await self._client.request("tokenizer", model=self.model))["tokenizer_json"]
            self.tokenizer = Tokenizer.for_model(tok_json, self.info, self.chat_template)
            tokenizer = self.tokenizer
            slots = [EngineSlot(f"engine-{i}", a) for i, a in enumerate(self._actors)]
            self.cluster = ClusterPool(
                slots,
                router_actor(self.router_config.model_copy(update={"block": self.info.page_size})),
                tokenizer.encode,
                self.info.page_size,
                self.workers,
                inferlet_dirs=self.inferlet_dirs,
                limits=self.limits,
                control_ip=ray.util.get_node_ip_address() if tcp else None,
                **self.pool_options,
            )
            await self.cluster.start()
            self.pool = self.cluster  # type: ignore[assignment]  # the HostPool interface (pool.py)
            self.state = "ready"
            log.info("serving %s on %d engines", self.model, self.engines)
        except Exception as e:  # noqa: BLE001 - any failure to start is reported, never raised into uvicorn
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            log.error("startup failed: %s", self.error)

    def engine_health(self) -> None:
        """None: Ray restarts the engine actors (``max_restarts``), the pool fails a lost engine's runs with
        ``engine_lost`` (503) and /metrics shows each engine's ``pie_engine_up``."""
        return None

    async def engine_stats(self) -> dict[str, dict[str, Any]] | None:
        """Every live engine's ``stats``, by engine name, asked on its own wire (not through its actor, whose
        calls are its health checks'); one that does not answer now shows its last reply. A lost engine's are
        dropped: its counters start again when it rejoins with a new engine."""
        if self.cluster is None or self.state not in ("ready", "draining"):
            return None
        live = [s for s in self.cluster.slots.values() if s.live and s.info is not None]
        replies = await asyncio.gather(*(self._stats_of(s.name, s.info) for s in live if s.info is not None))
        for slot, reply in zip(live, replies, strict=True):
            if reply is not None:
                self._last_stats[slot.name] = reply
        names = {s.name for s in live}
        self._last_stats = {k: v for k, v in self._last_stats.items() if k in names}
        for name in [k for k in self._stats_clients if k not in names]:
            self._stats_clients.pop(name)[1].close()
        return dict(self._last_stats)

    async def _stats_of(self, name: str, info: EngineInfo) -> dict[str, Any] | None:
        held = self._stats_clients.get(name)
        if held is not None and held[0] != info.address:  # a restarted engine
            self._stats_clients.pop(name)[1].close()
            held = None
        try:
            if held is None:
                client = Client(info.address)
                self._stats_clients[name] = (info.address, client)
                await asyncio.wait_for(
                    client.request("hello", version=PROTOCOL_VERSION, client="pie-serve-metrics", token=info.token),
                    5.0,
                )
            else:
                client = held[1]
            return await asyncio.wait_for(client.request("stats"), 5.0)
        except (TimeoutError, OSError, RuntimeError, PieError) as e:
            log.warning("engine %s stats unavailable: %s", name, e)
            client = self._stats_clients.pop(name, (None, None))[1]
            if client is not None:
                client.close()
            return None

    def cluster_counts(self) -> ClusterCounts | None:
        return self.cluster.counts() if self.cluster is not None else None

    async def close(self, drain_timeout: float) -> None:
        self.state = "draining"
        if self.cluster is not None:
            try:
                await self.cluster.drain(drain_timeout)
            finally:
                await self.cluster.close()
        if self._client is not None:
            self._client.close()
        for _, client in self._stats_clients.values():
            client.close()
        self._stats_clients.clear()
        for actor in self._actors:
            try:
                await asyncio.wait_for(actor.stop.remote(), 15)
            except Exception:  # noqa: BLE001 - a dead actor has nothing to stop
                pass
            ray.kill(actor, no_restart=True)
        if self._owns_ray:
            await asyncio.to_thread(ray.shutdown)
