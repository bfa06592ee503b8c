"""The cluster pool's health watcher without Ray: a late answer now and then keeps an engine, the configured
number of misses in a row loses it, and an answer from a new engine (the actor restarted between two asks)
loses the old one at once. The actors are stand-ins whose ``health.remote()`` answers as the test says."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from pie_runtime.cluster.pool import ClusterPool, EngineSlot
from pie_runtime.cluster.ray_actors import EngineHealth, EngineInfo

TIMEOUT = 0.05


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class Actor:
    """Answers each health ask with the next of ``answers``: an engine pid, or None for no answer in time."""

    def __init__(self, answers: list[int | None]):
        self.answers = list(answers)
        self.asks = 0
        self.health = _Method(self._health)

    async def _health(self) -> EngineHealth:
        self.asks += 1
        pid = self.answers.pop(0) if self.answers else 1
        if pid is None:
            await asyncio.sleep(10 * TIMEOUT)
        return EngineHealth(alive=True, engine_pid=pid or 1, free_pages=8, total_pages=8)


class Router:
    def __init__(self):
        self.lost: list[str] = []
        self.lose = _Method(self._lose)
        self.report = _Method(self._report)

    async def _lose(self, name: str) -> None:
        self.lost.append(name)

    async def _report(self, name: str, free: int) -> None:
        return None


async def watch(answers: list[int | None], asks: int) -> tuple[EngineSlot, Router]:
    """Runs the watcher of one live engine (pid 1) until it has asked ``asks`` times or lost the engine."""
    info = EngineInfo(
        name="e0", address="tcp://x", local_address="ipc://x", token=None, node_ip="x", node_id="n",
        actor_pid=0, engine_pid=1,
    )  # fmt: skip
    actor, router = Actor(answers), Router()
    slot = EngineSlot(name="e0", actor=actor, info=info, live=True)
    pool = ClusterPool([slot], router, encode=lambda s: [], page_size=16, health_interval=0.0,
                       health_timeout=TIMEOUT, health_misses=3)  # fmt: skip
    task = asyncio.create_task(pool._watch(slot))
    for _ in range(2000):
        if actor.asks >= asks or not slot.live:
            break
        await asyncio.sleep(0.005)
    pool._closed = True
    task.cancel()
    return slot, router


def lost(slot: EngineSlot) -> list[str]:
    return [what for _, what in slot.events if what.startswith("lost")]


async def test_misses_below_the_limit_keep_the_engine():
    slot, router = await watch([None, None, 1, None, None, 1, None, None], asks=10)
    assert slot.live and router.lost == []
    assert slot.health is not None and slot.health.free_pages == 8


async def test_the_limit_of_misses_in_a_row_loses_the_engine():
    slot, router = await watch([1, None, None, None], asks=10)
    assert not slot.live and router.lost == ["e0"]
    assert lost(slot) == [f"lost: no health report within {TIMEOUT} s, 3 times in a row"]


async def test_an_answer_from_a_new_engine_loses_the_old_one():
    slot, router = await watch([1, 1, 7], asks=10)
    assert not slot.live and router.lost == ["e0"]
    assert lost(slot) == ["lost: its actor restarted with a new engine (pid 7)"]


async def test_a_failed_rejoin_is_in_the_timeline_and_backs_off():
    """A lost engine whose restarted actor answers health but not ``info`` (a hung join): each try ends after
    ``join_timeout``, is written in the slot's timeline, and the pause before the next one doubles."""
    actor = Actor([])
    infos = 0

    async def hung_info() -> EngineInfo:
        nonlocal infos
        infos += 1
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    actor.info = _Method(hung_info)  # type: ignore[attr-defined]
    slot = EngineSlot(name="e0", actor=actor, live=False)
    pool = ClusterPool([slot], Router(), encode=lambda s: [], page_size=16, health_interval=0.1,
                       health_timeout=1.0, join_timeout=TIMEOUT)  # fmt: skip
    task = asyncio.create_task(pool._watch(slot))
    for _ in range(2000):
        if sum("join failed" in what for _, what in slot.events) >= 3:
            break
        await asyncio.sleep(0.005)
    pool._closed = True
    task.cancel()
    failed = [what for _, what in slot.events if "join failed" in what]
    assert len(failed) >= 3 and not slot.live and infos == len(failed)
    assert all(what.startswith("join failed (TimeoutError") for what in failed)
    assert [float(what.rsplit("in ", 1)[1].removesuffix(" s")) for what in failed[:3]] == [0.5, 1.0, 2.0]
