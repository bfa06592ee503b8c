"""Programs and channels over real sockets on the tiny model: host channel ops, waiting takes, poisoning by
a failed fire, and a fold set on the device leaving the working set exactly as a host-set fold would."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import inferlet
from inferlet.client import Client
from inferlet.programs import where
from pie_runtime.protocol import ErrorCode, PieError, pack
from tests.conftest import TINY, pages_free, start_engine

PROMPT = "The quick brown fox jumps over the lazy dog. Then the fox"


async def logits_of(ws, tokens) -> np.ndarray:
    fp = inferlet.ForwardPass(ws)
    fp.embed(tokens).readout(range(len(tokens)), inferlet.Logits())
    logits = (await fp.submit()).logits
    assert logits is not None
    return logits


async def refused(code, coro):
    with pytest.raises(PieError) as e:
        await coro
    assert e.value.code == code, e.value
    return e.value


async def test_host_channel_ops(tiny):
    ch = await inferlet.Channel.open(tiny, (2,), "int32", capacity=2)
    await refused(ErrorCode.CHANNEL_EMPTY, ch.take())
    assert await ch.put([1, 2]) == 1
    assert await ch.set([3, 4]) == 1  # replaces the front
    assert await ch.put([5, 6]) == 2
    await refused(ErrorCode.CHANNEL_FULL, ch.put([7, 8]))
    await refused(
        ErrorCode.INVALID_ARGUMENT,
        tiny.client.request(
            "channel_put", channel=ch.handle, value=inferlet.forward.encode_array(np.zeros(3, np.int32))
        ),
    )
    assert (await ch.read()).tolist() == [3, 4]
    assert (await ch.take(max=5)).tolist() == [[3, 4], [5, 6]]
    await ch.close()
    await refused(ErrorCode.UNKNOWN_CHANNEL, ch.read())


async def test_a_program_is_registered_by_hash_and_a_bad_one_refused(tiny):
    out = await inferlet.Channel.open(tiny, (1,), "int32", 4)
    prog = inferlet.trace(tiny, lambda p, out: p.put(out, p.logits([0]).argmax()), out)
    assert await prog.register() == prog.hash
    reply = await tiny.client.request("program_register", model=tiny.name, nodes=prog.nodes)
    assert reply["program"] == prog.hash
    await refused(
        ErrorCode.INVALID_PROGRAM,
        tiny.client.request(
            "program_register", nodes=[{"op": "logits", "attrs": {"rows": [0]}}, {"op": "rm_rf", "inputs": [0]}]
        ),
    )
    raw = Client(tiny.client.address)  # a malformed message's reply carries no id: read it raw
    try:
        reply = await raw.send_raw(pack({"id": 1, "op": "program_register", "nodes": [{"op": 3}]}))
        assert reply["error"]["code"] == ErrorCode.BAD_MESSAGE.value
    finally:
        raw.close()
    ws = tiny.working_set()
    unknown = {"ws": await ws.handle(), "tokens": [1, 2], "program": "0" * 32, "bindings": [out.handle]}
    await refused(ErrorCode.UNKNOWN_PROGRAM, tiny.client.request("fire", **unknown))
    assert (await inferlet.ForwardPass(ws).embed([1, 2]).submit()).committed == 2  # the refusal left nothing


async def test_epilogue_writes_and_a_waiting_take(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    out = await inferlet.Channel.open(tiny, (1,), "int32", 4)
    last = len(ids) - 1
    prog = inferlet.trace(tiny, lambda p, out: p.put(out, p.logits([last]).argmax()), out)
    ws = tiny.working_set()
    fp = inferlet.ForwardPass(ws).embed(ids).readout([last], inferlet.Argmax()).epilogue(prog)
    pending = await fp.launch()
    taken = await out.take()  # sent while the fire is in flight: answered after its step
    res = await pending
    assert taken.tolist() == [[int(res.tokens[0])]]
    assert ws.committed == len(ids)


async def test_a_failed_fire_poisons_the_channels_it_writes(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    empty = await inferlet.Channel.open(tiny, (1,), "int32", 1)
    out = await inferlet.Channel.open(tiny, (1,), "int32", 4)
    await out.put([5])  # a cell written before the failure

    def takes_from_empty(p, empty, out):
        x = p.take(empty)
        p.put(out, x + p.logits([0]).argmax())

    ws = tiny.working_set()
    await logits_of(ws, ids)
    free = await pages_free(tiny)
    fp = inferlet.ForwardPass(ws).embed([1, 2]).epilogue(inferlet.trace(tiny, takes_from_empty, empty, out))
    await refused(ErrorCode.CHANNEL_EMPTY, fp.submit())
    err = await refused(ErrorCode.CHANNEL_POISONED, out.take())
    assert "channel_empty" in err.message
    await refused(ErrorCode.CHANNEL_POISONED, out.read())
    # a data-dependent failure (a gather index past the vocab) is typed too
    other = await inferlet.Channel.open(tiny, (1,), "int32", 4)

    def gathers_far(p, other):
        far = p.const([[10**9]])
        p.put(other, p.logits([0]).gather(1, far).reshape(1).int())

    fp = inferlet.ForwardPass(ws).embed([3]).epilogue(inferlet.trace(tiny, gathers_far, other))
    await refused(ErrorCode.PROGRAM_FAILED, fp.submit())
    await refused(ErrorCode.CHANNEL_POISONED, other.take())
    # the working set keeps the folds the host fixed (rows 1, 2, 3), and nothing else leaked into it
    clean = tiny.working_set()
    await logits_of(clean, ids + [1, 2, 3])
    np.testing.assert_allclose(await logits_of(ws, [9]), await logits_of(clean, [9]), atol=1e-5)
    await ws.release()
    await clean.release()
    assert await pages_free(tiny) >= free


async def test_device_fold_equals_host_fold(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    junk = [11, 22, 33, 44]
    flag = await inferlet.Channel.open(tiny, (), "int32", 1)

    def fold_two(p, flag):  # a fold computed on the device: 2 unless the flag channel holds a nonzero
        p.fold(where(p.read(flag) == 0, 2, 1))

    async def run(device: bool):
        ws = tiny.working_set()
        await logits_of(ws, ids)
        fp = inferlet.ForwardPass(ws).embed(junk).readout([0], inferlet.Argmax())
        if device:
            await flag.set(0)
            fp.epilogue(inferlet.trace(tiny, fold_two, flag))
            res = await fp.submit()
            assert res.fold == 2 and not ws.pending_fold
        else:
            await fp.fold(inferlet.DEFERRED).submit()
            await ws.fold(2)
        committed = ws.committed
        free = await pages_free(tiny)
        after = await logits_of(ws, [7, 8])
        await ws.release()
        return committed, free, after

    dev, host = await run(True), await run(False)
    assert dev[0] == host[0] == len(ids) + 2
    assert dev[1] == host[1]
    np.testing.assert_allclose(dev[2], host[2], atol=1e-6)


async def test_concurrent_epilogues_of_one_step(tiny):
    prompts = [tiny.tokenizer.encode(f"Story {i}: once upon a time there") for i in range(4)]

    async def one(ids):
        out = await inferlet.Channel.open(tiny, (1,), "int32", 1)
        last = len(ids) - 1
        prog = inferlet.trace(tiny, lambda p, out: p.put(out, p.logits([last]).argmax()), out)
        ws = tiny.working_set()
        res = await inferlet.ForwardPass(ws).embed(ids).readout([last], inferlet.Argmax()).epilogue(prog).submit()
        got = (await out.take()).item()
        await ws.release()
        await out.close()
        return got, int(res.tokens[0])

    for got, expected in await asyncio.gather(*(one(p) for p in prompts)):
        assert got == expected


@pytest.fixture(scope="module")
def capped_engine(pie_home):
    """A tiny engine whose clients hold at most 2 programs."""
    eng = start_engine(pie_home, [TINY], "--max-programs", "2")
    yield eng
    eng.stop()


async def programs_held(client) -> int:
    return (await client.request("stats"))["programs"]


async def test_a_capped_engine_evicts_the_oldest_program_and_the_sdk_registers_it_again(capped_engine):
    session = await inferlet.connect(capped_engine.address)
    try:
        model = inferlet.model(TINY)
        out = await inferlet.Channel.open(model, (1,), "int32", 8)
        progs = [
            inferlet.trace(model, lambda p, out, k=k: p.put(out, p.logits([0]).argmax() + k), out) for k in range(3)
        ]
        ws = model.working_set()

        async def fire(k: int) -> None:  # the epilogue puts the greedy token plus k
            res = await inferlet.ForwardPass(ws).embed([1]).readout([0], inferlet.Argmax()).epilogue(progs[k]).submit()
            assert res.tokens is not None
            assert (await out.take()).tolist() == [[int(res.tokens[0]) + k]]

        for k in range(3):
            await fire(k)
        assert await programs_held(model.client) == 2  # registering progs[2] evicted progs[0]
        await fire(0)  # refused unknown_program, registered again (evicting progs[1]), fired
        assert await programs_held(model.client) == 2
        assert await progs[0].unregister() is True
        assert await progs[0].unregister() is False
        assert await programs_held(model.client) == 1
        raw = {"ws": await ws.handle(), "tokens": [1], "program": progs[0].hash, "bindings": [out.handle]}
        await refused(ErrorCode.UNKNOWN_PROGRAM, model.client.request("fire", **raw))
        await fire(0)  # the SDK registers an unregistered program at its next fire
    finally:
        session.client.close()


async def test_a_departed_clients_programs_are_dropped(capped_engine):
    session = await inferlet.connect(capped_engine.address)
    other = Client(capped_engine.address)
    try:
        model = inferlet.model(TINY)
        before = await programs_held(model.client)
        nodes = [{"op": "logits", "attrs": {"rows": [0]}}, {"op": "argmax", "inputs": [0]}]
        await other.request("program_register", model=TINY, nodes=nodes)
        assert await programs_held(model.client) == before + 1
        other.close()
        for _ in range(200):
            if await programs_held(model.client) == before:
                break
            await asyncio.sleep(0.05)
        assert await programs_held(model.client) == before
    finally:
        other.close()
        session.client.close()
