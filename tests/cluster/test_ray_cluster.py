"""Two engine replicas on a local Ray instance, behind the router: runs spread, a shared prefix stays on one
engine, and an engine actor killed mid-decode is left out, its runs end ``engine_lost`` (a completion is run
again on the other engine from its prompt, with the same greedy tokens), and the restarted actor rejoins.
Each engine's inferlet hosts are started by a host actor on the engine's node and stream their runs back.

The cluster runs as on several machines (``tcp=True``): engines on ``tcp://`` with tokens, hosts on their
engine's ``ipc://`` address, the server's control socket on ``tcp://``.

The engines run the tiny model with ``--simulate-step-ms`` so a 64-token decode lasts long enough to be
killed in the middle."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import pytest_asyncio

from pie_runtime.serve.backend import EngineSpec
from pie_runtime.serve.host_pool import RunEvent, RunFailed
from tests.conftest import TINY

ray = pytest.importorskip("ray")

from pie_runtime.cluster.backend import ClusterBackend  # noqa: E402 - after the skip
from pie_runtime.cluster.pool import ClusterPool  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

HERE = Path(__file__).parent
SYSTEMS = [  # distinct from their first tokens: prompts that share a long head would share an engine
    f"{name} speaking. You are a careful assistant for a library in a small town. Answer questions about "
    "opening hours, loans, late fees and the reading club, politely and briefly, and never invent a rule."
    for name in ("Ada", "Brook", "Cyrus", "Dmitri")
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(pie_home):
    spec = EngineSpec(
        [TINY],
        ["--kv-pages", "256", "--weights", "fp32", "--no-compile", "--pass-cost-rows", "0", "--threads", "1"]
        + ["--simulate-step-ms", "20"],
        env={"PIE_HOME": str(pie_home)},
    )
    backend = ClusterBackend(spec, 2, engine_cpus=0.5, inferlet_dirs=[HERE / "cluster_inferlets"], tcp=True)
    await backend.start()
    assert backend.state == "ready", backend.error
    yield backend
    await backend.close(5)
    assert not ray.is_initialized()


def pool(backend: ClusterBackend) -> ClusterPool:
    assert backend.cluster is not None
    return backend.cluster


def completion(prompt: str, max_tokens: int = 4) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def collect(p: ClusterPool, inferlet: str, args: dict, **kw) -> tuple[dict, list[str]]:
    texts: list[str] = []
    result: dict = {}
    async for ev in p.run(inferlet, args, **kw):
        if ev.kind == "text":
            texts.append(ev.text)
        else:
            result = ev.result or {}
    return result, texts


LIVE_WAIT = 3000  # tenths of a second an engine may take to come back (a loaded machine starts processes slowly)


async def until_live(slot) -> None:
    for _ in range(LIVE_WAIT):  # live after any earlier test's kill
        if slot.live:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{slot.name} did not come back")


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def test_hosts_run_on_their_engines_node_as_their_host_actors_children(cluster):
    import os

    for slot in pool(cluster).slots.values():
        await until_live(slot)
        assert slot.info is not None and slot.pool is not None and slot.hosts_parent is not None
        assert slot.hosts_node == slot.info.node_id  # NodeAffinitySchedulingStrategy on the engine actor's node
        assert slot.pool.engine_address == slot.info.local_address and slot.info.local_address.startswith("ipc://")
        assert slot.info.address.startswith("tcp://") and slot.pool.control_address.startswith("tcp://")
        pids = slot.pool.pids()
        assert len(pids) == cluster.workers
        assert slot.hosts_parent != os.getpid()
        assert all(parent_of(pid) == slot.hosts_parent for pid in pids)  # started there, not by the server


async def test_runs_stream_from_the_hosts_and_cancel(cluster):
    p = pool(cluster)
    result, texts = await collect(p, "text-completion", completion("Tell me a story about a lighthouse.", 24))
    assert len(texts) > 1 and "".join(texts) == result["text"]  # streamed as it was made, not at the end

    ids = cluster.tokenizer.encode("a run to cancel")  # type: ignore[union-attr]
    events: list[RunEvent] = []

    async def consume() -> None:
        async for ev in p.run("greedy_ids", {"ids": ids, "max_tokens": 400}, run_id="cancel-me"):
            events.append(ev)

    task = asyncio.create_task(consume())
    for _ in range(3000):
        if len(events) >= 2:
            break
        await asyncio.sleep(0.01)
    assert len(events) >= 2, "the run never streamed"
    assert await p.cancel("cancel-me")
    with pytest.raises(RunFailed) as failed:
        await task
    assert failed.value.code == "cancelled"
    assert p.engine_of("cancel-me") is None


async def test_shared_prefixes_stay_and_distinct_ones_spread(cluster):
    p = pool(cluster)
    start = len(p.placements)
    jobs = [(s, f"{SYSTEMS[s]}\nQuestion {u}: when do you open?") for u in range(3) for s in range(4)]
    for s, prompt in jobs[:4]:  # one a system prompt first, so the tree knows them
        await collect(p, "text-completion", completion(prompt), run_id=f"aff-{s}-0")
    await asyncio.gather(
        *(collect(p, "text-completion", completion(q), run_id=f"aff-{s}-{i}") for i, (s, q) in enumerate(jobs[4:], 1))
    )
    placed = {run_id: (engine, reason) for run_id, engine, reason in p.placements[start:]}
    home = {s: placed[f"aff-{s}-0"][0] for s in range(4)}
    assert set(home.values()) == {"engine-0", "engine-1"}  # new prefixes spread
    for run_id, (engine, reason) in placed.items():
        s = int(run_id.split("-")[1])
        if not run_id.endswith("-0"):
            assert (engine, reason) == (home[s], "cache")  # a shared prefix stays where it is cached


async def test_session_key_keeps_its_engine(cluster):
    p = pool(cluster)
    start = len(p.placements)
    for i in range(4):
        await collect(p, "text-completion", completion(f"unrelated prompt number {i}"), session="alice")
    assert len({engine for _, engine, _ in p.placements[start:]}) == 1


async def test_killed_engine_is_left_out_its_runs_end_and_it_rejoins(cluster):
    p = pool(cluster)
    prompt = SYSTEMS[0] + "\nWrite a long answer about the reading club."
    reference, _ = await collect(p, "text-completion", completion(prompt, 64))
    ids = cluster.tokenizer.encode("a greedy run from token ids")  # type: ignore[union-attr]

    # both runs on one engine (one session key), then that engine's actor is killed mid-decode
    retried = asyncio.create_task(collect(p, "text-completion", completion(prompt, 64), session="kill"))
    lost_run: list[RunEvent] = []

    async def not_retried() -> None:
        async for ev in p.run("greedy_ids", {"ids": ids, "max_tokens": 400}, session="kill", run_id="noretry"):
            lost_run.append(ev)

    lost = asyncio.create_task(not_retried())
    for _ in range(3000):
        if len(lost_run) >= 3:
            break
        await asyncio.sleep(0.01)
    assert len(lost_run) >= 3, "the run never started decoding"
    victim = p.slots[p.engine_of("noretry") or ""]
    old_pid = victim.info.engine_pid if victim.info else None
    killed_at = time.time()
    ray.kill(victim.actor, no_restart=False)

    with pytest.raises(RunFailed) as failed:
        await lost
    assert failed.value.code == "engine_lost"

    # nothing is placed on the lost engine, not even its session's runs; placed at once, before its actor
    # can restart (an idle machine restarts it within the retried run's decode)
    other = next(s for s in p.slots.values() if s is not victim)
    assert not victim.live
    await collect(p, "text-completion", completion("after the kill"), session="kill", run_id="after")
    assert [e for r, e, _ in p.placements if r == "after"] == [other.name]

    result, texts = await retried
    assert result["token_ids"] == reference["token_ids"]  # run again from its prompt: the same greedy tokens
    assert "".join(texts) == reference["text"]  # and its text streamed once, without repeats
    assert p.retries >= 1
    lost_at = next(t for t, what in victim.events if what.startswith("lost") and t >= killed_at)

    for _ in range(LIVE_WAIT):  # Ray restarts the actor, which starts a new engine; then it rejoins
        if victim.live:
            break
        await asyncio.sleep(0.1)
    assert victim.live and victim.info is not None and victim.info.engine_pid != old_pid
    rejoined_at = next(t for t, what in victim.events if what.startswith("joined") and t > lost_at)
    start = len(p.placements)
    await collect(p, "text-completion", completion("a brand new system prompt " * 8))
    assert [e for _, e, _ in p.placements[start:]] == [victim.name]  # empty cache: the least cached engine
    print(
        f"\nkill timeline: lost after {lost_at - killed_at:.2f} s, rejoined after {rejoined_at - killed_at:.2f} s"
        f" ({victim.events})"
    )


async def test_a_working_set_is_unknown_through_another_engines_connection(cluster):
    from inferlet.client import Client
    from pie_runtime.protocol import PieError
    from pie_runtime.protocol.messages import PROTOCOL_VERSION

    slots = list(pool(cluster).slots.values())
    for s in slots:
        await until_live(s)
    a, b = (Client(s.info.address) for s in slots[:2])  # type: ignore[union-attr]

    async def ask(c: Client, kind: str, **fields):  # a request to a dead engine would wait for ever
        return await asyncio.wait_for(c.request(kind, **fields), 60)

    try:
        for c, s in zip((a, b), slots, strict=False):
            await ask(c, "hello", version=PROTOCOL_VERSION, client="test", token=s.info.token)  # type: ignore[union-attr]
        ws = (await ask(a, "ws_open", model=TINY))["ws"]
        with pytest.raises(PieError) as refused:
            await ask(b, "ws_release", ws=ws)
        assert refused.value.code == "unknown_working_set"
        await ask(a, "ws_release", ws=ws)
    finally:
        a.close()
        b.close()


async def test_an_engine_process_that_dies_brings_its_actor_down_and_back(cluster):
    import os
    import signal

    p = pool(cluster)
    slot = p.slots["engine-1"]
    await until_live(slot)
    assert slot.info is not None
    old_pid = slot.info.engine_pid
    os.kill(old_pid, signal.SIGKILL)
    for _ in range(1200):
        if not slot.live:
            break
        await asyncio.sleep(0.05)
    assert not slot.live
    start = len(p.placements)
    await collect(p, "text-completion", completion("while one engine is down"))
    assert [e for _, e, _ in p.placements[start:]] == ["engine-0"]
    for _ in range(LIVE_WAIT):  # the actor exits with its engine; Ray restarts it with a new one
        if slot.live:
            break
        await asyncio.sleep(0.1)
    assert slot.live and slot.info is not None and slot.info.engine_pid != old_pid


async def test_a_dead_host_actor_is_replaced_while_its_engine_lives_on(cluster):
    p = pool(cluster)
    slot = p.slots["engine-0"]
    await until_live(slot)
    assert slot.info is not None
    engine_pid, old_parent = slot.info.engine_pid, slot.hosts_parent
    ray.kill(slot.host_actor, no_restart=True)
    for _ in range(LIVE_WAIT):  # lost for its runs, then joined again with a new host actor
        if slot.live and slot.hosts_parent != old_parent:
            break
        await asyncio.sleep(0.1)
    assert slot.live and slot.hosts_parent != old_parent
    assert any(what == "lost: its host actor is gone" for _, what in slot.events)
    assert slot.info.engine_pid == engine_pid  # the engine itself was not restarted
    assert slot.pool is not None and all(parent_of(pid) == slot.hosts_parent for pid in slot.pool.pids())
    start = len(p.placements)
    result, texts = await collect(p, "text-completion", completion("a prompt for the new hosts " * 4, 8))
    assert [e for _, e, _ in p.placements[start:]] == ["engine-0"]  # its empty cache: the least cached
    assert "".join(texts) == result["text"]
