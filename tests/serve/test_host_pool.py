"""The inferlet host pool (pie_runtime/serve/host_pool.py, inferlet_host.py) against real engines: many runs in
one host, failures that cost only their own runs, host restarts, cancellation, limits and shutdown."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inferlet.client import Client
from pie_runtime.protocol.messages import PROTOCOL_VERSION
from pie_runtime.serve.host_pool import HostLimits, HostPool, RunEvent, RunFailed
from tests.conftest import TINY, start_engine

pytestmark = pytest.mark.e2e  # every test starts host processes

HERE = Path(__file__).parent / "hosts_inferlets"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "import numpy as np\n",
    "Water boils at",
    "My favourite book is",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def bare_engine(pie_home):
    """The tiny model without a prefix cache: every page is free again once nothing holds it."""
    eng = start_engine(pie_home, [TINY], "--no-prefix-cache")
    yield eng
    eng.stop()


@pytest.fixture
async def pool(bare_engine):
    p = HostPool(bare_engine.address, inferlet_dirs=[HERE], heartbeat_timeout_s=3.0)
    await p.start()
    yield p
    await p.close()


async def collect(pool: HostPool, name: str, args: dict, **kw) -> tuple[str, dict]:
    """(the emitted text, the result) of one run."""
    text: list[str] = []
    result: dict | None = None
    async for event in pool.run(name, args, **kw):
        if event.kind == "text":
            assert result is None, "text after the result"
            text.append(event.text)
        else:
            assert result is None, "two results"
            result = event.result
    assert result is not None
    return "".join(text), result


async def failure(pool: HostPool, name: str, args: dict, **kw) -> RunFailed:
    with pytest.raises(RunFailed) as info:
        await collect(pool, name, args, **kw)
    return info.value


async def first_text(agen) -> RunEvent:
    event = await anext(agen)
    assert event.kind == "text"
    return event


async def engine_pages(address: str) -> tuple[int, int]:
    """(free, total) KV pages of the tiny model, from the engine's stats."""
    client = Client(address)
    try:
        await client.request("hello", version=PROTOCOL_VERSION, client="test")
        stats = (await client.request("stats"))["models"][TINY]
    finally:
        client.close()
    return stats["pages_free"], stats["pages_total"]


async def all_pages_free(address: str) -> bool:
    """Polls the engine until every page is free again (a departed client is released on its next loop turn);
    False if they never are."""
    for _ in range(200):
        free, total = await engine_pages(address)
        if free == total:
            return True
        await asyncio.sleep(0.05)
    return False


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that nobody reaped yet does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return not any(line.startswith("State:") and "Z" in line.split()[1] for line in status.splitlines())


def host_children() -> list[int]:
    """Our child processes that are inferlet hosts, from /proc."""
    me, out = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if ppid == me and b"pie_runtime.serve.inferlet_host" in cmdline:
            out.append(int(entry.name))
    return out


async def test_concurrent_runs_equal_sequential_on_the_default_model(engine):
    pool = HostPool(engine.address)
    await pool.start()
    try:
        args = [{"prompt": p, "max_tokens": 10, "temperature": 0} for p in PROMPTS]
        alone = [await collect(pool, "text-completion", a) for a in args]
        together = await asyncio.gather(*(collect(pool, "text-completion", a) for a in args))
    finally:
        await pool.close()
    for (text_a, res_a), (text_b, res_b) in zip(alone, together):
        assert res_b["token_ids"] == res_a["token_ids"]
        assert text_a == text_b == res_a["text"]  # the streamed text is the result's
    assert len({tuple(r["token_ids"]) for _, r in alone}) == len(PROMPTS)


async def test_a_crashing_inferlet_fails_only_its_run(pool, bare_engine):
    ok_args = {"prompt": "Tell me a story", "max_tokens": 24}
    outcomes = await asyncio.gather(
        collect(pool, "text-completion", ok_args),
        failure(pool, "crash", {}),
        collect(pool, "text-completion", ok_args),
    )
    assert outcomes[1].code == "inferlet_error" and "boom" in outcomes[1].message
    assert outcomes[0][1]["token_ids"] == outcomes[2][1]["token_ids"]
    assert len(outcomes[0][1]["token_ids"]) == 24
    assert pool.restarts == 0
    assert await all_pages_free(bare_engine.address)  # the crashed run's open working set was released


@pytest.mark.parametrize("how", ["sigkill", "os_exit"])
async def test_a_dead_host_fails_only_its_runs_and_is_restarted(bare_engine, how):
    pool = HostPool(bare_engine.address, workers=2, inferlet_dirs=[HERE])
    await pool.start()
    try:
        runs = {f"r{i}": pool.run("leaky", {}, run_id=f"r{i}") for i in range(4)}
        for agen in runs.values():
            await first_text(agen)  # all four decode
        on = {rid: pool.host_pid(rid) for rid in runs}
        assert len(set(on.values())) == 2  # spread over both hosts
        if how == "sigkill":
            victim = on["r0"]
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
        else:
            exiting = pool.run("exit_host", {}, run_id="exit")
            victim = int((await first_text(exiting)).text)
            assert (await failure_of(exiting)).code == "host_crashed"
        doomed = {rid for rid, pid in on.items() if pid == victim}
        for rid, agen in runs.items():
            if rid in doomed:
                assert (await failure_of(agen)).code == "host_crashed"
            else:
                await first_text(agen)  # still decoding after the other host died
                assert await pool.cancel(rid)
                assert (await failure_of(agen)).code == "cancelled"
        assert await all_pages_free(bare_engine.address)  # the engine released the dead host's working sets
        _, result = await collect(pool, "text-completion", {"prompt": "After the crash", "max_tokens": 4})
        assert len(result["token_ids"]) == 4
        assert pool.restarts == 1 and len(pool.pids()) == 2 and victim not in pool.pids()
    finally:
        await pool.close()


async def failure_of(agen) -> RunFailed:
    """Reads a run to its end, which must be a failure."""
    with pytest.raises(RunFailed) as info:
        async for _ in agen:
            pass
    return info.value


async def test_cancel_releases_what_the_run_held(pool, bare_engine):
    agen = pool.run("leaky", {}, run_id="leak")
    await first_text(agen)
    free, total = await engine_pages(bare_engine.address)
    assert free < total
    assert pool.running() == 1
    assert await pool.cancel("leak")
    assert (await failure_of(agen)).code == "cancelled"
    # cancel() returns once the host has released the run's two working sets and its channel
    assert await engine_pages(bare_engine.address) == (total, total)
    assert pool.running() == 0 and not await pool.cancel("leak")


async def test_a_run_that_returns_without_releasing_leaves_nothing_behind(pool, bare_engine):
    text, result = await collect(pool, "leaky", {"steps": 3, "pause": 0})
    assert result == {"steps": 3} and text == "0 1 2 "
    free, total = await engine_pages(bare_engine.address)
    assert free == total


async def test_bad_arguments_and_unknown_inferlets(pool):
    for args in ({"prompt": 5}, {"prompt": "x", "max_tokens": "many"}, {"prompt": "x", "bogus": 1}, {}):
        err = await failure(pool, "text-completion", args)
        assert err.code == "bad_arguments", args
    assert "bogus" in (await failure(pool, "text-completion", {"prompt": "x", "bogus": 1})).message
    assert (await failure(pool, "no-such-inferlet", {})).code == "not_found"
    _, result = await collect(pool, "text-completion", {"prompt": "still serving", "max_tokens": 3})
    assert len(result["token_ids"]) == 3
    assert pool.restarts == 0
    assert {"text-completion", "leaky", "crash"} <= set(pool.inferlets())


async def test_a_blocked_event_loop_is_detected_by_heartbeats(bare_engine):
    pool = HostPool(bare_engine.address, inferlet_dirs=[HERE], heartbeat_s=0.2, heartbeat_timeout_s=1.0)
    await pool.start()
    try:
        err = await failure(pool, "hang", {})
        assert err.code == "host_crashed" and "heartbeat" in err.message
        _, result = await collect(pool, "text-completion", {"prompt": "after the hang", "max_tokens": 3})
        assert len(result["token_ids"]) == 3 and pool.restarts == 1
    finally:
        await pool.close()


async def test_a_stalled_server_loop_kills_no_healthy_host(bare_engine):
    """The server's own event loop stalls past the heartbeat timeout (a starved or stopped server process: a
    loaded machine during long prefills) while a host waits on its run: the host's heartbeats sit unread on
    the server's socket, not missing, so the watchdog must not take the stall for the host's silence."""
    pool = HostPool(bare_engine.address, inferlet_dirs=[HERE], heartbeat_s=0.2, heartbeat_timeout_s=1.0)
    await pool.start()
    try:
        agen = pool.run("nap", {"seconds": 4.0})
        await first_text(agen)
        for _ in range(3):
            time.sleep(2.5)  # blocks this loop (the server's): no tick, no receive for 2.5 timeouts
            await asyncio.sleep(0.05)
        result = None
        async for event in agen:
            result = event.result
        assert result == {"slept": 4.0}
        assert pool.restarts == 0
    finally:
        await pool.close()


async def test_limits_and_clean_environment(bare_engine, monkeypatch):
    monkeypatch.setenv("PIE_TEST_SECRET", "do-not-leak")
    limits = HostLimits(address_space_bytes=6 << 30, cpu_seconds=3600, open_files=200, clean_env=True)
    pool = HostPool(bare_engine.address, inferlet_dirs=[HERE], limits=limits)
    await pool.start()
    try:
        _, probe = await collect(pool, "probe", {})
        assert (probe["address_space"], probe["cpu"], probe["open_files"]) == (6 << 30, 3600, 200)
        assert "PIE_TEST_SECRET" not in probe["env"] and probe["model"] == TINY
        err = await failure(pool, "probe", {"hog": 16 << 30})  # past the address-space limit
        assert err.code == "inferlet_error" and "MemoryError" in err.message
        _, again = await collect(pool, "probe", {})
        assert again == probe and pool.restarts == 0  # the host survived its run's blow-up
    finally:
        await pool.close()


async def test_drain_lets_runs_finish_and_close_leaves_no_child(bare_engine):
    pool = HostPool(bare_engine.address, workers=2, inferlet_dirs=[HERE])
    await pool.start()
    pids = pool.pids()
    assert sorted(pids) == sorted(host_children())
    short = pool.run("leaky", {"steps": 10, "pause": 0.05})
    await first_text(short)
    drained = asyncio.create_task(pool.drain(timeout=600))
    await asyncio.sleep(0)  # the drain has begun
    with pytest.raises(RunFailed) as refused:
        await collect(pool, "text-completion", {"prompt": "too late", "max_tokens": 2})
    assert refused.value.code == "overloaded"
    rest = [e async for e in short]
    assert rest[-1].kind == "result" and rest[-1].result == {"steps": 10}
    await drained  # returns once the last run ended, not at its timeout
    assert pool.running() == pool.waiting() == 0
    await pool.close()
    assert host_children() == []
    assert not any(alive(pid) for pid in pids)


async def test_drain_cancels_what_outlives_its_timeout(bare_engine):
    pool = HostPool(bare_engine.address, inferlet_dirs=[HERE])
    await pool.start()
    try:
        forever = pool.run("leaky", {})
        await first_text(forever)
        await pool.drain(timeout=0.5)
        assert (await failure_of(forever)).code == "cancelled"
        assert pool.running() == 0
        free, total = await engine_pages(bare_engine.address)
        assert free == total  # drain returned after the host released the cancelled run's working sets
    finally:
        await pool.close()
    assert host_children() == []


SERVER = """
import asyncio, sys
from pie_runtime.serve.host_pool import HostPool

async def main():
    pool = HostPool(sys.argv[1], workers=2)
    await pool.start()
    print(*pool.pids(), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_hosts_die_with_a_killed_server(bare_engine):
    server = subprocess.Popen([sys.executable, "-c", SERVER, bare_engine.address], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        ready, _, _ = select.select([server.stdout], [], [], 180)  # a server that never starts fails, not hangs
        pids = [int(p) for p in server.stdout.readline().split()] if ready else []
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        server.kill()  # SIGKILL: no cleanup code of the server runs
        server.wait()
    for _ in range(200):
        if not any(alive(p) for p in pids):
            break
        await asyncio.sleep(0.05)
    assert not any(alive(p) for p in pids)
