"""Long runs behind `pie serve`. The server's KV admission (serve/kv_gate.py): a run waits, first come first in,
until the KV its working sets can grow to fits the engine's pool beside the runs in it, instead of failing in the
engine with ``out_of_pages``; through a real server whose pool holds two of four concurrent long completions, all
four complete and at most two ran at once (``pie_requests_running_max``). And an engine that answers nothing for
longer than the hosts' heartbeat timeout (stopped: a long prefill's step on a loaded machine, as the server sees
it) is no crashed host: the run in flight completes once it answers again, and meanwhile /metrics answers with
the engine's last figures (``pie_engine_stats_stale_seconds``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time

import httpx
import pytest

from pie_runtime.serve.kv_gate import KVGate
from tests.conftest import TINY
from tests.serve.server_proc import start_serve


async def test_runs_wait_for_room_in_order_and_leave_cleanly():
    gate = KVGate(10)
    await gate.acquire(6)
    second = asyncio.create_task(gate.acquire(6))  # does not fit beside the first
    third = asyncio.create_task(gate.acquire(2))  # would fit, but waits behind the second (no starvation)
    await asyncio.sleep(0.01)
    assert not second.done() and not third.done() and gate.waiting == 2
    gate.release(6)
    await asyncio.wait_for(asyncio.gather(second, third), 1)
    assert (gate.held, gate.admitted, gate.most_admitted) == (8, 2, 2)
    waiting = asyncio.create_task(gate.acquire(5))
    await asyncio.sleep(0.01)
    waiting.cancel()  # a client that left while waiting holds nothing
    await asyncio.gather(waiting, return_exceptions=True)
    assert gate.waiting == 0 and gate.held == 8
    gate.release(6)
    gate.release(2)
    assert gate.held == 0 and gate.admitted == 0


async def test_a_run_larger_than_the_pool_goes_alone_and_no_gate_admits_all():
    gate = KVGate(10)
    await gate.acquire(25)  # alone: the engine says what it can do with it (its prompt may be cached)
    other = asyncio.create_task(gate.acquire(1))
    await asyncio.sleep(0.01)
    assert not other.done()
    gate.release(25)
    await asyncio.wait_for(other, 1)
    off = KVGate(None)
    for _ in range(5):
        await off.acquire(1000)
    assert off.admitted == 5


@pytest.fixture(scope="module")
def server(pie_home):
    # 80 pages of 16 rows; a 600-token prompt with 16 new tokens can grow to 39 pages: two fit at once
    s = start_serve(pie_home, TINY, "--kv-pages", "80", "--pass-cost-rows", "0", "--no-prefix-cache")
    yield s
    s.stop()


def metrics(s) -> dict[str, float]:
    page = httpx.get(f"{s.base}/metrics", timeout=120).text  # the timeout: a safety net, not a bound under test
    return {line.split()[0]: float(line.split()[-1]) for line in page.splitlines() if line.startswith("pie_")}


def completion(s, prompt: list[int], max_tokens: int = 16) -> httpx.Response:
    body = {"model": TINY, "prompt": prompt, "max_tokens": max_tokens}
    return httpx.post(f"{s.base}/v1/completions", json=body, timeout=600)


USED, RUNNING = 'pie_kv_pages_used{model="tiny-smol"}', 'pie_requests_running{model="tiny-smol"}'
OK = 'pie_requests_total{inferlet="text-completion",model="tiny-smol",outcome="ok"}'


@pytest.mark.e2e
def test_a_stopped_engine_is_no_crashed_host_and_metrics_keep_answering(server):
    s = server
    assert completion(s, [1, 2, 3], 2).status_code == 200
    before = metrics(s)
    assert before[USED] == 0 and before["pie_engine_stats_stale_seconds"] == 0
    engine = httpx.get(f"{s.base}/health", timeout=60).json()["engine"]["pid"]
    os.kill(engine, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            reply = pool.submit(completion, s, [5 + k for k in range(300)])
            time.sleep(14)  # past the hosts' heartbeat timeout (10 s) and the server's stats wait (5 s)
            during = metrics(s)
        finally:
            os.kill(engine, signal.SIGCONT)
        r = reply.result()
    assert during[USED] == 0  # the last figures the engine gave
    assert during["pie_engine_stats_stale_seconds"] > 5 and during[RUNNING] == 1
    assert r.status_code == 200, r.text
    after = metrics(s)
    assert after["pie_engine_restarts_total"] == 0 and after["pie_engine_stats_stale_seconds"] == 0
    assert after[OK] == before[OK] + 1


@pytest.mark.e2e
def test_long_completions_beyond_the_pool_wait_and_all_complete(server):
    # without the gate the four would reach the engine together and two would fail there (out_of_pages)
    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base, timeout=600) as c:
            prompts = [[1 + (i * 7919 + k * 104729) % 49000 for k in range(600)] for i in range(4)]
            bodies = [{"model": TINY, "prompt": p, "max_tokens": 16} for p in prompts]
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    replies = asyncio.run(main())
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    assert metrics(server)['pie_requests_running_max{model="tiny-smol"}'] == 2
