"""The engine over real sockets: fold rules, fork, sampling, batching and refusals, on real models."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import inferlet
from inferlet.client import Client
from pie_runtime.protocol import ErrorCode, PieError, pack
from pie_runtime.protocol.codec import MAX_MESSAGE_BYTES
from tests.conftest import TINY, pages_free
from tests.procs import expect_line

PROMPT = "The quick brown fox jumps over the lazy dog. Then the fox"


@pytest.fixture
async def smol(engine):
    session = await inferlet.connect(engine.address)
    yield inferlet.model()
    session.client.close()


async def logits_of(model, ws, tokens, rows=None) -> np.ndarray:
    fp = inferlet.ForwardPass(ws)
    fp.embed(tokens)
    fp.readout(rows if rows is not None else range(len(tokens)), inferlet.Logits())
    logits = (await fp.submit()).logits
    assert logits is not None
    return logits


async def test_chunked_prompt_equals_one_pass(tiny):
    ids = tiny.tokenizer.encode(PROMPT * 3)
    whole = await logits_of(tiny, tiny.working_set(), ids)
    ws = tiny.working_set()
    parts, start = [], 0
    for size in (5, 1, 17, len(ids) - 23):
        parts.append(await logits_of(tiny, ws, ids[start : start + size]))
        start += size
    assert ws.committed == len(ids)
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-4)


async def test_deferred_fold_equals_never_writing_rejected_rows(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    junk = [11, 22, 33, 44]
    ws = tiny.working_set()
    await logits_of(tiny, ws, ids)
    fp = inferlet.ForwardPass(ws)
    fp.embed(junk).readout([0], inferlet.Argmax()).fold(inferlet.DEFERRED)
    await fp.submit()
    assert ws.pending_fold and ws.committed == len(ids)
    # a second fire while the fold is pending is refused
    with pytest.raises(PieError) as e:
        await logits_of(tiny, ws, [5])
    assert e.value.code == ErrorCode.FOLD_PENDING
    assert await ws.fold(1) == len(ids) + 1
    after = await logits_of(tiny, ws, [7, 8])

    clean = tiny.working_set()
    await logits_of(tiny, clean, ids + junk[:1])
    expected = await logits_of(tiny, clean, [7, 8])
    assert ws.committed == clean.committed == len(ids) + 3
    np.testing.assert_allclose(after, expected, atol=1e-5)


async def test_explicit_fold_count_overwrites_the_rest(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    ws = tiny.working_set()
    fp = inferlet.ForwardPass(ws)
    fp.embed(ids + [99, 98, 97]).fold(len(ids) + 1)
    await fp.submit()
    assert ws.committed == len(ids) + 1
    got = await logits_of(tiny, ws, [5, 6])
    clean = tiny.working_set()
    await logits_of(tiny, clean, ids + [99])
    np.testing.assert_allclose(got, await logits_of(tiny, clean, [5, 6]), atol=1e-5)


async def test_truncate_drops_a_committed_suffix(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    ws = tiny.working_set()
    await logits_of(tiny, ws, ids + [1, 2, 3])
    assert await ws.truncate(len(ids)) == len(ids)
    got = await logits_of(tiny, ws, [4])
    clean = tiny.working_set()
    await logits_of(tiny, clean, ids)
    np.testing.assert_allclose(got, await logits_of(tiny, clean, [4]), atol=1e-5)
    with pytest.raises(PieError) as e:
        await ws.truncate(10_000)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT


async def test_fork_shares_prefix_pages_and_branches_match_fresh_runs(tiny):
    ids = tiny.tokenizer.encode(PROMPT * 4)  # several full pages
    ws = tiny.working_set()
    await logits_of(tiny, ws, ids)
    free_before = await pages_free(tiny)
    child = await ws.fork()
    assert child.committed == ws.committed
    assert await pages_free(tiny) == free_before  # the fork itself costs no page
    a = await logits_of(tiny, ws, [10, 11])
    b = await logits_of(tiny, child, [20, 21])
    # only the written tail page is copied for the second writer
    assert free_before - await pages_free(tiny) <= 2
    for branch, got in (([10, 11], a), ([20, 21], b)):
        fresh = tiny.working_set()
        await logits_of(tiny, fresh, ids)
        np.testing.assert_allclose(got, await logits_of(tiny, fresh, branch), atol=1e-5)
        await fresh.release()


async def test_release_returns_pages_and_refuses_later_fires(tiny):
    free0 = await pages_free(tiny)
    ws = tiny.working_set()
    await logits_of(tiny, ws, list(range(100, 150)))
    assert await pages_free(tiny) < free0
    await ws.release()
    assert await pages_free(tiny) == free0
    with pytest.raises(PieError) as e:
        await logits_of(tiny, ws, [1])
    assert e.value.code == ErrorCode.UNKNOWN_WORKING_SET


async def test_seeded_sampling_is_reproducible(tiny):
    ids = tiny.tokenizer.encode(PROMPT)

    async def draw(seed):
        ws = tiny.working_set()
        fp = inferlet.ForwardPass(ws)
        fp.embed(ids).readout([len(ids) - 1] * 16, inferlet.Sample(temperature=1.0, seed=seed))
        toks = (await fp.submit()).tokens.tolist()
        await ws.release()
        return toks

    assert await draw(3) == await draw(3)
    assert await draw(3) != await draw(4)


async def test_distribution_readout_follows_top_k_and_top_p(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    ws = tiny.working_set()
    fp = inferlet.ForwardPass(ws)
    row = [len(ids) - 1]
    fp.embed(ids).readout(row, inferlet.Logits()).readout(row, inferlet.Distribution(0.8, top_k=5))
    fp.readout(row, inferlet.Distribution(1.0, top_p=0.5))
    res = await fp.submit()
    from inferlet.spec.distribution import filter_distribution

    logits, topk, topp = (r.logits if r.logits is not None else r.probs for r in res.readouts)
    assert logits is not None and topk is not None and topp is not None
    assert (topk[0] > 0).sum() == 5
    np.testing.assert_allclose(topk, filter_distribution(logits, 0.8, top_k=5), atol=1e-5)
    np.testing.assert_allclose(topp, filter_distribution(logits, 1.0, top_p=0.5), atol=1e-5)


async def test_mask_restricts_argmax(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    words = (tiny.vocab_size + 31) // 32
    mask = np.zeros((1, words), dtype=np.uint32)
    mask[0, 1000 // 32] |= np.uint32(1 << (1000 % 32))
    mask[0, 4242 // 32] |= np.uint32(1 << (4242 % 32))
    ws = tiny.working_set()
    fp = inferlet.ForwardPass(ws)
    fp.embed(ids).readout([len(ids) - 1], inferlet.Argmax(), mask=mask.view(np.int32))
    fp.readout([len(ids) - 1], inferlet.Logits())
    res = await fp.submit()
    logits = res.readouts[1].logits[0]
    assert int(res.tokens[0]) == (1000 if logits[1000] >= logits[4242] else 4242)


async def test_concurrent_fires_from_one_client(tiny):
    prompts = [tiny.tokenizer.encode(f"Story number {i}: once upon a time") for i in range(6)]

    async def one(ids):
        ws = tiny.working_set()
        out = await logits_of(tiny, ws, ids, rows=[len(ids) - 1])
        await ws.release()
        return out

    together = await asyncio.gather(*(one(p) for p in prompts))
    for ids, got in zip(prompts, together):
        np.testing.assert_allclose(got, await one(ids), atol=1e-4)


# ---- refusals: each gets a typed error and the engine keeps serving -----------------------------------


async def test_bad_inputs_get_typed_errors_and_engine_survives(tiny):
    ws = tiny.working_set()
    ids = tiny.tokenizer.encode(PROMPT)
    await logits_of(tiny, ws, ids)
    raw = Client(tiny.client.address)
    try:
        for payload, code in [
            (b"\x92\x01", ErrorCode.BAD_MESSAGE),  # truncated msgpack
            (pack({"id": 1, "op": "nope"}), ErrorCode.UNKNOWN_OP),
            (pack({"id": 2, "op": "fire", "ws": "x", "tokens": [1]}), ErrorCode.BAD_MESSAGE),
            (b"\x00" * (MAX_MESSAGE_BYTES + 10), ErrorCode.MESSAGE_TOO_LARGE),
        ]:
            reply = await raw.send_raw(payload)
            assert reply["ok"] is False and reply["error"]["code"] == code.value
    finally:
        raw.close()

    async def refused(code, coro):
        with pytest.raises(PieError) as e:
            await coro
        assert e.value.code == code, e.value

    await refused(ErrorCode.TOKEN_OUT_OF_RANGE, logits_of(tiny, ws, [tiny.vocab_size]))
    await refused(ErrorCode.TOKEN_OUT_OF_RANGE, logits_of(tiny, ws, [-1]))
    await refused(ErrorCode.ROW_OUT_OF_RANGE, logits_of(tiny, ws, [1, 2], rows=[2]))
    await refused(ErrorCode.CAPACITY, logits_of(tiny, tiny.working_set(), [1] * (tiny.max_positions + 1), rows=[0]))
    hogs = [tiny.working_set() for _ in range(3)]  # 3 x 1500 rows > the 256-page pool of 4096 rows
    free0 = await pages_free(tiny)
    await logits_of(tiny, hogs[0], [1] * 1500, rows=[0])
    await logits_of(tiny, hogs[1], [1] * 1500, rows=[0])
    await refused(ErrorCode.OUT_OF_PAGES, logits_of(tiny, hogs[2], [1] * 1500, rows=[0]))
    for hog in hogs:
        await hog.release()
    assert await pages_free(tiny) == free0
    await refused(ErrorCode.UNSUPPORTED, _mtp(tiny, ws))
    await refused(ErrorCode.UNKNOWN_WORKING_SET, tiny.client.request("ws_fold", ws=987654, n=0))
    await refused(ErrorCode.NO_PENDING_FOLD, ws.fold(0))
    await refused(ErrorCode.UNKNOWN_MODEL, tiny.client.request("ws_open", model="no-such-model"))
    # after all that, the same working set still works and nothing leaked into it
    assert ws.committed == len(ids)
    clean = tiny.working_set()
    await logits_of(tiny, clean, ids)
    np.testing.assert_allclose(await logits_of(tiny, ws, [3]), await logits_of(tiny, clean, [3]), atol=1e-5)


async def _mtp(model, ws):
    fp = inferlet.ForwardPass(ws)
    fp.embed([1]).readout([0], inferlet.MTP(2))
    return await fp.submit()


KILLED_CLIENT = textwrap.dedent(
    """
    import asyncio, sys, inferlet
    async def go():
        await inferlet.connect(sys.argv[1])
        m = inferlet.model(sys.argv[2])
        for _ in range(3):
            ws = m.working_set()
            fp = inferlet.ForwardPass(ws)
            fp.embed(list(range(100, 180)))
            await fp.submit()
        print("holding", flush=True)
        await asyncio.sleep(600)
    asyncio.run(go())
    """
)


async def test_killed_client_pages_return(tiny):
    free0 = await pages_free(tiny)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, tiny.client.address, TINY], stdout=subprocess.PIPE, text=True
    )
    try:
        expect_line(proc, "holding")
        assert await pages_free(tiny) < free0
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    deadline = time.monotonic() + 10
    while await pages_free(tiny) != free0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert await pages_free(tiny) == free0


async def test_refused_request_with_readable_id_reaches_its_caller(tiny):
    # a wrong field type is refused before validation finishes; the reply must still carry the request's id
    with pytest.raises(PieError) as e:
        await asyncio.wait_for(tiny.client.request("fire", ws="not-an-int", tokens=[1]), timeout=10)
    assert e.value.code == ErrorCode.BAD_MESSAGE
    with pytest.raises(PieError) as e:
        await asyncio.wait_for(tiny.client.request("no_such_op"), timeout=10)
    assert e.value.code == ErrorCode.UNKNOWN_OP


async def test_settle_with_the_next_fire_equals_a_separate_fold(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    results = []
    for separate in (True, False):
        ws = tiny.working_set()
        await logits_of(tiny, ws, ids)
        fp = inferlet.ForwardPass(ws)
        fp.embed([11, 22, 33]).fold(inferlet.DEFERRED)
        await fp.submit()
        if separate:
            await ws.fold(2)
        else:
            ws.settle(2)
        results.append(await logits_of(tiny, ws, [7, 8]))
        assert ws.committed == len(ids) + 4
        await ws.release()
    np.testing.assert_allclose(results[0], results[1], atol=1e-6)


async def test_refused_fire_does_not_apply_its_settle(tiny):
    ws = tiny.working_set()
    await logits_of(tiny, ws, [1, 2, 3])
    fp = inferlet.ForwardPass(ws)
    fp.embed([4, 5]).fold(inferlet.DEFERRED)
    await fp.submit()
    with pytest.raises(PieError) as e:  # settle past the deferred window
        await tiny.client.request("fire", ws=await ws.handle(), tokens=[6], settle=3)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT
    with pytest.raises(PieError) as e:  # a bad token refuses the fire, and its settle with it
        await tiny.client.request("fire", ws=await ws.handle(), tokens=[tiny.vocab_size], settle=1)
    assert e.value.code == ErrorCode.TOKEN_OUT_OF_RANGE
    assert (await tiny.client.request("ws_fold", ws=await ws.handle(), n=2))["committed"] == 5
