"""Hands admitted requests to the host pool, one inferlet run each, and keeps what the metrics need.

At most ``max_running`` runs are in hosts at once, and only as many as the engine's KV pool holds (``KVGate``:
each run's KV bound, page groups counted); later requests wait (their queue time) and past ``max_waiting``
waiting ones a request gets 503 ``overloaded``. Those slots are the server's (``RunSlots``),
shared by the main hosts' runs and every key's uploaded-inferlet runs: a key that uploads its own inferlet
gets no run slots beside them. A run whose consumer goes away (a client
that disconnects mid-stream, a cancelled handler) is cancelled in its host, which releases its working sets.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from .auth import Lease
from .errors import run_failed, unavailable
from .host_pool import HostPool, RunEvent, RunFailed
from .kv_gate import KVGate
from .metrics import Metrics


@dataclass
class RunStats:
    """What one run took: filled as its events arrive."""

    arrival: float
    started: float = 0.0
    first_text: float = 0.0
    last_text: float = 0.0
    itl: Any = None  # the inter-token histogram of the run's labels, looked up once (it is observed a token)


class RunSlots:
    """The server's ``max_running`` run slots and its count of runs waiting for one (at most ``max_waiting``)."""

    def __init__(self, max_running: int, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.sem = asyncio.Semaphore(max_running)
        self.kv = KVGate()  # its capacity is set once the engine's pool is known (Server.runs)
        self.waiting = 0
        self.running = 0


class Runs:
    def __init__(self, pool: HostPool, metrics: Metrics, model: str, slots: RunSlots) -> None:
        self.pool = pool
        self.metrics = metrics
        self.model = model
        self.slots = slots

    @property
    def waiting(self) -> int:
        """Runs waiting for a slot, the server's (every pool's)."""
        return self.slots.waiting

    @property
    def running(self) -> int:
        """Runs in hosts, the server's (every pool's)."""
        return self.slots.running

    def new_id(self) -> str:
        return f"run-{uuid.uuid4().hex[:16]}"

    async def events(
        self,
        inferlet: str,
        args: dict[str, Any],
        lease: Lease | None = None,
        run_id: str | None = None,
        arrival: float | None = None,
        session: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RunEvent]:
        """The run's events (text, then one result); a failure raises the APIError for it. The lease is
        released and the run cancelled in its host (if it still runs) when this iterator ends, however.
        ``session``: the routing key of ``pie serve --engines N`` (the ``x-session-id`` header or ``user``);
        ``cache_salt``: the prefix-cache salt of its working sets (its key's, Server.salt)."""
        labels = {"model": self.model, "inferlet": inferlet}
        st = RunStats(arrival=arrival or time.monotonic())
        run_id = run_id or self.new_id()
        done = False
        slots = self.slots
        try:
            if slots.waiting >= slots.max_waiting and slots.sem.locked():
                raise unavailable(f"{slots.waiting} requests are waiting; try again later", "overloaded")
            pages = lease.kv.pages if lease is not None else 0
            slots.waiting += 1
            try:
                await slots.sem.acquire()
                try:
                    await slots.kv.acquire(pages)
                except BaseException:
                    slots.sem.release()
                    raise
            finally:
                slots.waiting -= 1
            slots.running += 1
            try:
                st.started = time.monotonic()
                self.metrics.queue.labels(**labels).observe(st.started - st.arrival)
                async for ev in self.pool.run(inferlet, args, run_id=run_id, session=session, cache_salt=cache_salt):
                    if ev.kind == "text":
                        self._text(st, labels)
                    elif ev.result is not None:
                        done = True
                        self._result(st, labels, ev.result, lease)
                    yield ev
                done = True
            except RunFailed as e:
                done = True
                self.metrics.requests.labels(**labels, outcome=e.code).inc()
                raise run_failed(e.code, e.message) from e
            finally:
                slots.running -= 1
                slots.kv.release(pages)
                slots.sem.release()
                if not done:
                    self.metrics.requests.labels(**labels, outcome="cancelled").inc()
                    await asyncio.shield(self._cancel(run_id))
        finally:
            if lease is not None:
                lease.release()

    async def _cancel(self, run_id: str) -> None:
        try:
            await self.pool.cancel(run_id)
        except Exception:  # noqa: BLE001 - the run may have ended meanwhile; nothing to undo
            pass

    def _text(self, st: RunStats, labels: dict[str, str]) -> None:
        now = time.monotonic()
        if not st.first_text:
            st.first_text = now
            self.metrics.ttft.labels(**labels).observe(now - st.arrival)
            st.itl = self.metrics.itl.labels(**labels)
        else:
            st.itl.observe(now - st.last_text)
        st.last_text = now

    def _result(self, st: RunStats, labels: dict[str, str], result: dict, lease: Lease | None) -> None:
        now = time.monotonic()
        if not st.first_text:  # a run that emitted nothing: its first token came with its result
            self.metrics.ttft.labels(**labels).observe(now - st.arrival)
        self.metrics.e2e.labels(**labels).observe(now - st.arrival)
        self.metrics.requests.labels(**labels, outcome="ok").inc()
        stats = result.get("stats") if isinstance(result, dict) else None
        if isinstance(stats, dict):
            prompt = int(stats.get("prompt_tokens", 0) or 0)
            choices = result.get("choices") or [result]
            generated = sum(len(c.get("token_ids") or []) for c in choices if isinstance(c, dict))
            self.metrics.prompt_tokens.labels(**labels).inc(prompt)
            self.metrics.generation_tokens.labels(**labels).inc(generated)
            if lease is not None:
                lease.settle(generated)

    async def collect(self, events: AsyncIterator[RunEvent]) -> dict[str, Any]:
        """The result of a run, its text events dropped."""
        result: dict[str, Any] | None = None
        async for ev in events:
            if ev.kind == "result":
                result = ev.result if isinstance(ev.result, dict) else {"value": ev.result}
        if result is None:
            raise run_failed("inferlet_error", "the run ended without a result")
        return result
