"""Run-ahead on the tiny model: the engine re-fires a channel-fed greedy pass with no round trip; it equals
the host-driven loop, stops at a stop token, at its budgets and at a channel flag, waits when its output is
full, and a client that dies mid run has its fires stopped and its pages returned."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import inferlet
from tests.conftest import TINY
from tests.procs import expect_line

PROMPT = "Numbers: 3 1 4 1 5 9 2 6 5 3 5 8 9 7 9 3 2 3 8 4 6 2 6 4"


async def stats(model) -> dict:
    return await model.client.request("stats")


async def host_greedy(model, ids, n) -> list[int]:
    ws = model.working_set()
    res = await inferlet.ForwardPass(ws).embed(ids).readout([len(ids) - 1], inferlet.Argmax()).submit()
    out = [int(res.tokens[0])]
    while len(out) < n:
        res = await inferlet.ForwardPass(ws).embed([out[-1]]).readout([0], inferlet.Argmax()).submit()
        out.append(int(res.tokens[0]))
    await ws.release()
    return out


async def start_run(model, ids, out_capacity=64, programs: list | None = None, **budget):
    """Prefill (its epilogue writes the first token) and a run-ahead behind it. Returns (ws, out, flag, task);
    the two traced programs go into ``programs`` when given."""
    inp = await inferlet.Channel.open(model, (1,), "int32", 1)
    out = await inferlet.Channel.open(model, (1,), "int32", out_capacity)
    flag = await inferlet.Channel.open(model, (), "int32", 1)
    last = len(ids) - 1

    def first(p, inp, out):
        t = p.logits([last]).argmax()
        p.put(inp, t)
        p.put(out, t)

    def step(p, inp, out):
        t = p.logits([0]).argmax()
        p.put(inp, t)
        p.put(out, t)
        p.fold(1)

    traced = [inferlet.trace(model, first, inp, out), inferlet.trace(model, step, inp, out)]
    if programs is not None:
        programs += traced
    ws = model.working_set()
    await inferlet.ForwardPass(ws).embed(ids).epilogue(traced[0]).launch()
    fp = inferlet.ForwardPass(ws).embed_from(inp).epilogue(traced[1])
    task = await fp.run_ahead(out, stop_channel=flag, **budget).launch()
    return ws, out, flag, task


async def drain(out, task) -> list[int]:
    got = []
    while True:
        try:
            got += (await out.take(max=64)).reshape(-1).tolist()
        except inferlet.PieError as e:
            assert e.code == inferlet.ErrorCode.CHANNEL_EMPTY
            return got


async def test_run_ahead_equals_the_host_loop_and_stops_at_its_token_budget(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    ref = await host_greedy(tiny, ids, 12)
    ws, out, _, task = await start_run(tiny, ids, budget_tokens=11)
    got = await drain(out, task)
    res = await task
    assert got == ref  # the prefill's token, then 11 from the run
    assert res.run == {"rounds": 11, "tokens": 11, "reason": "budget_tokens"}
    assert res.committed == len(ids) + 11


async def test_run_ahead_stops_at_a_stop_token(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    ref = await host_greedy(tiny, ids, 16)
    at = next((i for i in range(2, 16) if ref[i] not in ref[1:i]), 1)  # first produced by round `at`
    ws, out, _, task = await start_run(tiny, ids, budget_tokens=100, stop_tokens=[ref[at]])
    got = await drain(out, task)
    res = await task
    assert got == ref[: at + 1]
    assert res.run == {"rounds": at, "tokens": at, "reason": "stop_token"}


async def test_releasing_the_working_set_stops_a_run(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    free0 = (await stats(tiny))["models"][TINY]["pages_free"]
    ws, out, _, task = await start_run(tiny, ids, budget_tokens=1500)
    await out.take()
    await ws.release()
    with pytest.raises(inferlet.PieError) as e:
        await task
    assert e.value.code == inferlet.ErrorCode.UNKNOWN_WORKING_SET
    after = await stats(tiny)
    assert after["run_ahead"] == 0 and after["models"][TINY]["pages_free"] == free0


async def test_run_ahead_stops_at_its_round_budget_and_waits_for_room(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    ref = await host_greedy(tiny, ids, 9)
    ws, out, _, task = await start_run(tiny, ids, out_capacity=2, budget_rounds=8)
    got = []
    while len(got) < 9:
        await asyncio.sleep(0.05)  # a slow consumer: the run pauses while its output channel is full
        got += (await out.take()).reshape(-1).tolist()
    res = await task
    assert got == ref and res.run["reason"] == "budget_rounds" and res.run["rounds"] == 8


async def test_unregistering_the_programs_of_a_running_run_ahead_lets_it_finish(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    ref = await host_greedy(tiny, ids, 9)
    programs: list = []
    ws, out, _, task = await start_run(tiny, ids, out_capacity=2, budget_rounds=8, programs=programs)
    got = (await out.take()).reshape(-1).tolist()  # the run is under way (and pauses while its output is full)
    assert [await p.unregister() for p in programs] == [True, True]
    while len(got) < 9:
        await asyncio.sleep(0.02)
        got += (await out.take()).reshape(-1).tolist()
    res = await task
    assert got == ref and res.run["reason"] == "budget_rounds" and res.run["rounds"] == 8


async def test_the_host_stops_a_run_with_the_flag_channel(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    ws, out, flag, task = await start_run(tiny, ids, budget_tokens=1500)
    first = (await out.take()).reshape(-1).tolist()
    await flag.set(1)
    res = await task
    got = first + await drain(out, task)
    assert res.run["reason"] == "stop_channel"
    assert len(got) == res.run["tokens"] + 1 < 1500
    assert res.committed == len(ids) + res.run["rounds"]
    assert (await stats(tiny))["run_ahead"] == 0


DYING_CLIENT = textwrap.dedent(
    """
    import asyncio, sys, inferlet
    from tests.engine.programs.test_run_ahead import start_run
    async def go():
        await inferlet.connect(sys.argv[1])
        m = inferlet.model(sys.argv[2])
        ws, out, flag, task = await start_run(m, list(range(100, 180)), out_capacity=4096, budget_tokens=1900)
        await out.take()
        print("running", flush=True)
        await asyncio.sleep(600)
    asyncio.run(go())
    """
)


async def test_a_client_dying_mid_run_stops_its_fires_and_returns_its_pages(tiny):
    before = await stats(tiny)
    free0 = before["models"][TINY]["pages_free"]
    proc = subprocess.Popen(
        [sys.executable, "-c", DYING_CLIENT, tiny.client.address, TINY],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        expect_line(proc, "running")
        assert (await stats(tiny))["run_ahead"] == 1
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    deadline = time.monotonic() + 10
    while (await stats(tiny))["run_ahead"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    after = await stats(tiny)
    assert after["run_ahead"] == 0 and after["models"][TINY]["queued"] == 0
    assert after["models"][TINY]["pages_free"] == free0
    assert after["channels"] == before["channels"]
    steps = after["steps"]
    await asyncio.sleep(0.3)
    assert (await stats(tiny))["steps"] - steps <= 2  # the engine went idle


async def test_a_take_with_min_waits_for_a_batch(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    ref = await host_greedy(tiny, ids, 12)
    ws, out, _, task = await start_run(tiny, ids, budget_tokens=11)
    first = (await out.take(max=64, min=6)).reshape(-1).tolist()
    assert len(first) >= 6
    rest = await drain(out, task)
    await task
    assert first + rest == ref
