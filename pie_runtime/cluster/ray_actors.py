"""The Ray actors of ``pie serve --engines N``: Ray places them, watches them and restarts them; the data plane
stays the engines' ZeroMQ wire (a Ray call per forward pass would cost about a millisecond).

- ``EngineActor``: starts one engine process (``pie engine``) on its node, on an ``ipc://`` address when the
  cluster is this machine, else on ``tcp://NODE_IP:PORT`` with a token and also on an ``ipc://`` one for the
  inferlet hosts beside it (``host_actor.py``, placed on the engine actor's node); the engine dies with the actor
  (``PR_SET_PDEATHSIG``), and the actor with its engine (so that Ray restarts both). ``health()`` reads the
  engine's ``stats`` over the wire: free KV pages, live working sets, queued fires. Created with
  ``max_restarts``, so Ray starts a new engine when one is killed.
- ``RouterActor``: one ``router.Router`` (the policy, pure Python) that every server process shares.

Imported only when Ray is wanted; Ray is the optional extra ``pie-runtime[ray]``.
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
import threading
import uuid
from typing import Any

import ray
import zmq
from pydantic import BaseModel

from ..launcher import EmbeddedEngine
from ..protocol.codec import pack, unpack
from ..protocol.messages import PROTOCOL_VERSION
from .router import Placement, Router, RouterConfig


class EngineInfo(BaseModel):
    """Where an engine listens and what runs it."""

    name: str
    address: str  # where the server reaches it
    local_address: str  # where a client on its node does (its inferlet hosts): ipc://
    token: str | None
    node_ip: str
    node_id: str  # Ray's node id, where its hosts are placed
    actor_pid: int
    engine_pid: int


class EngineHealth(BaseModel):
    """An engine's load report (its ``stats``, summed over its models)."""

    alive: bool
    engine_pid: int = 0  # the engine process answering (a restarted actor answers with a new one)
    stale: bool = False  # alive, but its load could not be read this time
    free_pages: int = 0
    total_pages: int = 0
    working_sets: int = 0
    queued: int = 0


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


class EngineActor:
    def __init__(self, name: str, models: list[str], engine_args: list[str], env: dict[str, str], tcp: bool) -> None:
        self.name = name
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        extra = list(engine_args)
        self.token: str | None = None
        self.local_address = ""
        if tcp:
            self.token = secrets.token_hex(16)
            address = f"tcp://{self.node_ip}:{_free_port(self.node_ip)}"
            self.local_address = f"ipc://{tempfile.gettempdir()}/pie-{os.getpid()}-{uuid.uuid4().hex[:8]}-local.sock"
            extra += ["--listen", address, "--token", self.token]  # the last --listen wins
            extra += ["--also-listen", self.local_address]
        self.engine = EmbeddedEngine(models, extra, env=env, die_with_parent=True)
        if tcp:
            self.engine.address = address
        else:
            self.local_address = self.engine.address
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.engine.address)
        self._ids = 0
        self._stopping = False
        self._request("hello", version=PROTOCOL_VERSION, client=f"ray-{name}", token=self.token)
        threading.Thread(target=self._die_with_engine, daemon=True).start()

    def _die_with_engine(self) -> None:
        self.engine.proc.wait()
        if not self._stopping:
            os._exit(1)  # an unexpected death: Ray restarts the actor, which starts a new engine

    def _request(self, op: str, timeout_ms: int = 2000, **fields: Any) -> dict:
        self._ids += 1
        self._sock.send(pack({"id": self._ids, "op": op, **fields}))
        while self._sock.poll(timeout_ms):
            reply = unpack(self._sock.recv())
            if reply.get("id") == self._ids:
                if not reply.get("ok"):
                    raise RuntimeError(f"{op}: {reply.get('error')}")
                return reply
        raise TimeoutError(f"the engine did not answer {op} within {timeout_ms} ms")

    def info(self) -> EngineInfo:
        return EngineInfo(
            name=self.name,
            address=self.engine.address,
            local_address=self.local_address,
            token=self.token,
            node_ip=self.node_ip,
            node_id=self.node_id,
            actor_pid=os.getpid(),
            engine_pid=self.engine.proc.pid,
        )

    def health(self) -> EngineHealth:
        """Dead only when the engine process is; a busy engine (a long step) that does not answer ``stats``
        within half a second is alive with its load unknown (``stale``)."""
        if self.engine.proc.poll() is not None:
            return EngineHealth(alive=False)
        try:
            stats = self._request("stats", timeout_ms=500)
        except (TimeoutError, RuntimeError):
            return EngineHealth(alive=True, engine_pid=self.engine.proc.pid, stale=True)
        models = stats["models"].values()
        return EngineHealth(
            alive=True,
            engine_pid=self.engine.proc.pid,
            free_pages=sum(m["pages_free"] for m in models),
            total_pages=sum(m["pages_total"] for m in models),
            working_sets=stats["working_sets"],
            queued=sum(m["queued"] for m in models),
        )

    def stop(self) -> None:
        self._stopping = True
        self._sock.close(0)
        self.engine.stop()


class RouterActor:
    """One ``Router`` behind a Ray actor (Ray runs its calls one at a time, in order)."""

    def __init__(self, config: RouterConfig) -> None:
        self.router = Router(config)

    def add(self, engine: str) -> None:
        self.router.add(engine)

    def lose(self, engine: str) -> None:
        self.router.lose(engine)

    def report(self, engine: str, free_pages: int | None) -> None:
        self.router.report(engine, free_pages)

    def place(self, tokens: list[int], session: str | None, pages: int, exclude: list[str]) -> Placement:
        return self.router.place(tokens, session, pages, exclude)

    def done(self, engine: str) -> None:
        self.router.done(engine)

    def loads(self) -> dict[str, int]:
        return {e: s.in_flight for e, s in self.router.engines.items() if s.live}


def engine_actor(
    name: str,
    models: list[str],
    engine_args: list[str],
    env: dict[str, str],
    *,
    tcp: bool,
    num_cpus: float,
    max_restarts: int,
):
    """Creates an engine actor (Ray restarts it up to ``max_restarts`` times, -1: always)."""
    cls = ray.remote(EngineActor).options(num_cpus=num_cpus, max_restarts=max_restarts)
    return cls.remote(name, models, engine_args, env, tcp)


def router_actor(config: RouterConfig):
    return ray.remote(RouterActor).options(num_cpus=0).remote(config)
