"""``ClusterPool``: what ``pie serve --engines N`` hands its runs to, in place of one ``HostPool``. Same
interface (``run``, ``cancel``, ``inferlets``, ``drain``, ``close``), over N engine actors, each with its own
``HostPool`` of inferlet hosts on the engine's wire. The hosts run on the engine's node, started by a
``HostActor`` pinned there (``host_actor.py``), and speak to their engine over ``ipc://``; the pool here
supervises them and streams their runs over its control socket (``tcp://`` when ``control_ip`` is given).

- **Placement**: each run is placed by the router actor (``router.py``: session key, cache-aware, imbalance
  guard, refusals) on the prompt's token ids; its working sets live on that engine for the whole run, since
  its host speaks only to that engine.
- **Health**: a watcher per engine asks its actor for ``health()`` every ``health_interval`` seconds; a dead
  actor or engine, an answer from a new engine (the actor restarted between two asks), or no answer within
  ``health_timeout`` ``health_misses`` times in a row marks the engine **lost**: the router places nothing
  there, its runs end with ``engine_lost`` at once (none waits on a dead socket), its hosts are killed. One
  late answer is not enough: on a loaded machine an engine busy with a long step answers late and is not dead.
- **Retry**: a run with a text ``prompt`` (every completion) that lost its engine is run once more on another
  engine from its prompt. Text already streamed is not sent twice: the retry's text must begin with it (a
  greedy or seeded run does) and only the rest goes out; a retry that parts from it fails ``engine_lost``.
- **Rejoin**: Ray restarts the actor (``max_restarts``), which starts a new engine; the watcher then starts
  a new host pool on it and the router adds it back, with an empty cache. A join that fails (an answer not
  within ``join_timeout``, hosts that did not start) is logged in the slot's timeline and tried again after a
  pause that doubles from 0.5 s up to 10 s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from ..serve.host_pool import HostPool, RunEvent, RunFailed
from ..serve.limits import HostLimits
from ..serve.metrics import ClusterCounts
from .host_actor import RayLauncher, host_actor
from .ray_actors import EngineHealth, EngineInfo
from .router import NoEngine

log = logging.getLogger("pie.cluster")


@dataclass
class EngineSlot:
    """One engine actor as the server sees it."""

    name: str
    actor: Any  # ray ActorHandle of EngineActor
    info: EngineInfo | None = None
    pool: HostPool | None = None
    host_actor: Any = None  # ray ActorHandle of HostActor, on the engine's node
    hosts_node: str | None = None  # the Ray node id its host actor reported
    hosts_parent: int | None = None  # the host actor's pid: its hosts' parent
    live: bool = False
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    health: EngineHealth | None = None
    generation: int = 0  # joins so far: a run placed before a rejoin is not counted against the new engine
    events: list[tuple[float, str]] = field(default_factory=list)  # (time.time(), what): the timeline


def _replaced(slot: EngineSlot, health: EngineHealth) -> bool:
    """The answer came from another engine than the one the slot joined (its actor restarted unseen)."""
    return bool(health.engine_pid) and slot.info is not None and health.engine_pid != slot.info.engine_pid


@dataclass
class _Placed:
    slot: EngineSlot
    run_id: str


class ClusterPool:
    def __init__(
        self,
        slots: list[EngineSlot],
        router: Any,  # ray ActorHandle of RouterActor
        encode: Callable[[str], list[int]],
        page_size: int,
        workers: int = 1,
        *,
        inferlet_dirs: list[Path] | None = None,
        limits: HostLimits | None = None,
        health_interval: float = 0.25,
        health_timeout: float = 1.5,
        health_misses: int = 3,
        join_timeout: float = 60.0,
        host_options: dict[str, Any] | None = None,
        control_ip: str | None = None,
    ) -> None:
        self.slots = {s.name: s for s in slots}
        self.router = router
        self.encode = encode
        self.page_size = page_size
        self.workers = workers
        self.inferlet_dirs = list(inferlet_dirs or [])
        self.limits = limits
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.health_misses = health_misses
        self.join_timeout = join_timeout
        self.host_options = dict(host_options or {})
        self.control_ip = control_ip  # the server's address the hosts reach; None: ipc:// (one machine)
        self.retries = 0  # runs run again after their engine was lost
        self.placements: list[tuple[str, str, str]] = []  # (run id, engine, reason), in order: for tests and bench
        self.placed_by: collections.Counter[tuple[str, str]] = collections.Counter()  # (engine, reason) → runs
        self.refusals: collections.Counter[str] = collections.Counter()  # engine → runs it refused
        self.unplaced = 0  # runs no engine would take
        self._placed: dict[str, _Placed] = {}
        self._watchers: list[asyncio.Task] = []
        self._draining = False
        self._closed = False

    # --- lifecycle ---

    async def start(self) -> None:
        """Starts each engine's host pool, adds the engines to the router and starts watching them."""
        await asyncio.gather(*(self._join(s) for s in self.slots.values()))
        self._watchers = [asyncio.create_task(self._watch(s)) for s in self.slots.values()]

    async def _join(self, slot: EngineSlot) -> None:
        info: EngineInfo = await asyncio.wait_for(slot.actor.info.remote(), self.join_timeout)
        actor = host_actor(info.node_id)
        try:
            node, parent = await asyncio.wait_for(actor.where.remote(), self.join_timeout)
            pool = HostPool(
                info.local_address,
                self.workers,
                token=info.token,
                inferlet_dirs=self.inferlet_dirs,
                limits=self.limits,
                launcher=RayLauncher(actor, lambda: self._host_actor_gone(slot, actor)),
                control_ip=self.control_ip,
                **self.host_options,
            )
            await pool.start()
        except BaseException:
            _kill_actor(actor)
            raise
        slot.info, slot.pool, slot.host_actor = info, pool, actor
        slot.hosts_node, slot.hosts_parent = node, parent
        slot.generation += 1
        slot.lost = asyncio.Event()
        await self.router.add.remote(slot.name)
        # live, and its timeline entry, only once the router places on it: whoever sees it live can use it
        slot.live = True
        slot.events.append((time.time(), f"joined (engine pid {info.engine_pid})"))
        log.info("engine %s joined at %s (its hosts on node %s)", slot.name, info.address, node)

    async def _lose(self, slot: EngineSlot, why: str) -> None:
        slot.live = False
        slot.lost.set()
        slot.events.append((time.time(), f"lost: {why}"))
        log.warning("engine %s lost: %s", slot.name, why)
        await self.router.lose.remote(slot.name)
        pool, slot.pool = slot.pool, None
        if pool is not None:
            await pool.close(kill=True)
        actor, slot.host_actor = slot.host_actor, None
        if actor is not None:
            _kill_actor(actor)

    def _host_actor_gone(self, slot: EngineSlot, actor: Any) -> None:
        """The engine's host actor died (killed, or Ray lost it) while its engine lives: the engine is lost
        for its runs (they retry elsewhere), and the watcher joins it again with a new host actor."""
        if slot.live and slot.host_actor is actor and not self._closed:
            asyncio.get_running_loop().create_task(self._lose(slot, "its host actor is gone"))

    async def _watch(self, slot: EngineSlot) -> None:
        misses = 0  # health asks in a row not answered in time
        join_pause, join_at = 0.0, 0.0  # a failed join backs off: each try starts a host actor and its hosts
        while not self._closed:
            health: EngineHealth | None
            try:
                health = await asyncio.wait_for(slot.actor.health.remote(), self.health_timeout)
                misses = 0
                why = "" if health is not None and health.alive else "its engine process died"
            except TimeoutError:
                misses += 1
                health, why = None, ""
                if misses >= self.health_misses:
                    why = f"no health report within {self.health_timeout} s, {misses} times in a row"
            except Exception as e:  # noqa: BLE001 - Ray's actor errors: the actor died or is restarting
                health, why = None, f"{type(e).__name__}"
            if slot.live and not why and health is not None and _replaced(slot, health):
                why = f"its actor restarted with a new engine (pid {health.engine_pid})"
            if slot.live and why:
                await self._lose(slot, why)
            elif slot.live and health is not None and not health.stale:
                slot.health = health
                await self.router.report.remote(slot.name, health.free_pages)
            elif not slot.live and health is not None and health.alive and time.monotonic() >= join_at:
                join_pause = await self._rejoin(slot, join_pause)  # the restarted actor's new engine
                join_at = time.monotonic() + join_pause
            await asyncio.sleep(self.health_interval)

    async def _rejoin(self, slot: EngineSlot, pause: float) -> float:
        """Joins ``slot`` again; returns the pause before the next try: 0 when it joined, else ``pause``
        doubled (from 0.5 s, at most 10 s), since each try starts a host actor and its hosts."""
        if self._closed:
            return 0.0
        try:
            await self._join(slot)
            return 0.0
        except Exception as e:  # noqa: BLE001 - not up yet, or its hosts did not start: try again later
            pause = min(max(2 * pause, 0.5), 10.0)
            why = f"{type(e).__name__}: {e}".strip()
            slot.events.append((time.time(), f"join failed ({why}); next try in {pause:.1f} s"))
            log.warning("engine %s could not rejoin (%s); next try in %.1f s", slot.name, why, pause)
            return pause

    # --- the HostPool interface ---

    def inferlets(self) -> dict[str, Path]:
        for s in self.slots.values():
            if s.pool is not None:
                return s.pool.inferlets()
        return HostPool("ipc:///nowhere", inferlet_dirs=self.inferlet_dirs).inferlets()

    async def run(
        self,
        inferlet: str,
        args: dict,
        *,
        run_id: str | None = None,
        timeout: float | None = None,
        session: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RunEvent]:
        """As ``HostPool.run``, on the engine the router picks; a lost engine fails the run ``engine_lost``
        after its one retry (see the module docstring)."""
        if self._draining:
            raise RunFailed("overloaded", "the server is shutting down")
        run_id = run_id or uuid.uuid4().hex
        prompt = args.get("prompt")
        tokens = self.encode(prompt) if isinstance(prompt, str) else []
        n = int(args.get("n", 1) or 1)
        pages = n * math.ceil((len(tokens) + int(args.get("max_tokens", 0) or 0)) / self.page_size)
        sent = ""  # text the consumer has had
        tried: list[str] = []
        while True:
            try:
                placement = await self.router.place.remote(tokens, session, pages, tried)
            except NoEngine as e:
                self.unplaced += 1
                raise RunFailed("overloaded", str(e)) from None
            slot = self.slots[placement.engine]
            tried.append(slot.name)
            self.placements.append((run_id, slot.name, placement.reason))
            self.placed_by[slot.name, placement.reason] += 1
            for refused in placement.candidates[: placement.candidates.index(slot.name)]:
                self.refusals[refused] += 1
            replay = sent
            try:
                async for ev in self._on(slot, inferlet, args, run_id, timeout, cache_salt):
                    if ev.kind == "text" and replay:
                        keep = min(len(replay), len(ev.text))
                        if ev.text[:keep] != replay[:keep]:
                            raise RunFailed("engine_lost", "the retry on another engine parted from the text sent")
                        replay, ev = replay[keep:], RunEvent("text", text=ev.text[keep:])
                        if not ev.text:
                            continue
                    if ev.kind == "text":
                        sent += ev.text
                    yield ev
                return
            except RunFailed as e:
                if e.code != "engine_lost" or not isinstance(prompt, str) or len(tried) > 1:
                    raise
                self.retries += 1
                log.warning("run %s lost engine %s; running it again from its prompt", run_id, slot.name)

    async def _on(
        self,
        slot: EngineSlot,
        inferlet: str,
        args: dict,
        run_id: str,
        timeout: float | None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RunEvent]:
        """The run's events from ``slot``'s hosts, cut short with ``engine_lost`` the moment it is lost."""
        pool, lost, generation = slot.pool, slot.lost, slot.generation
        try:
            if pool is None or lost.is_set():
                raise RunFailed("engine_lost", f"engine {slot.name} is gone")
            self._placed[run_id] = _Placed(slot, run_id)
            events = pool.run(inferlet, args, run_id=run_id, timeout=timeout, cache_salt=cache_salt).__aiter__()
            lost_wait = asyncio.ensure_future(lost.wait())
            try:
                while True:
                    step = asyncio.ensure_future(events.__anext__())
                    await asyncio.wait([step, lost_wait], return_when=asyncio.FIRST_COMPLETED)
                    if lost.is_set():
                        step.cancel()
                        with contextlib.suppress(BaseException):
                            await step
                        raise RunFailed("engine_lost", f"engine {slot.name} was lost mid-run")
                    try:
                        ev = step.result()
                    except StopAsyncIteration:
                        return
                    yield ev
            finally:
                lost_wait.cancel()
                with contextlib.suppress(BaseException):
                    await events.aclose()  # type: ignore[attr-defined]
        except RunFailed as e:
            if lost.is_set() and e.code != "engine_lost":  # the hosts were killed with the engine
                raise RunFailed("engine_lost", f"engine {slot.name} was lost mid-run") from None
            raise
        finally:
            self._placed.pop(run_id, None)
            if slot.generation == generation and not lost.is_set():
                await self.router.done.remote(slot.name)

    async def cancel(self, run_id: str) -> bool:
        placed = self._placed.get(run_id)
        if placed is None or placed.slot.pool is None:
            return False
        return await placed.slot.pool.cancel(run_id)

    def running(self) -> int:
        return len(self._placed)

    def waiting(self) -> int:
        return sum(s.pool.waiting() for s in self.slots.values() if s.pool is not None)

    async def drain(self, timeout: float) -> None:
        self._draining = True
        pools = [s.pool for s in self.slots.values() if s.pool is not None]
        await asyncio.gather(*(p.drain(timeout) for p in pools))

    async def close(self) -> None:
        self._draining = self._closed = True
        for w in self._watchers:
            w.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        pools = [s.pool for s in self.slots.values() if s.pool is not None]
        await asyncio.gather(*(p.close() for p in pools))
        for s in self.slots.values():
            if s.host_actor is not None:
                _kill_actor(s.host_actor)
                s.host_actor = None

    def counts(self) -> ClusterCounts:
        in_flight = collections.Counter(p.slot.name for p in self._placed.values())
        return ClusterCounts(
            live={name: s.live for name, s in self.slots.items()},
            in_flight={name: in_flight[name] for name in self.slots},
            placements=dict(self.placed_by),
            refusals=dict(self.refusals),
            unplaced=self.unplaced,
            retries=self.retries,
        )

    def engine_of(self, run_id: str) -> str | None:
        """The engine a running run is on (for operators and tests)."""
        placed = self._placed.get(run_id)
        return placed.slot.name if placed is not None else None


def _kill_actor(actor: Any) -> None:
    with contextlib.suppress(Exception):  # already gone
        ray.kill(actor, no_restart=True)
