"""KV editing on the real default model, in fp32 (torch's attention) and int4 (the native step): the
streaming-llm inferlet (sinks + window, inferlets/streaming-llm.py) keeps its pages flat and, until its first
eviction, decodes text-completion's tokens; a working set whose rows were evicted decodes from the kept rows at
the positions they were written at."""

from __future__ import annotations

import asyncio

import pytest

import inferlet
from pie_runtime.store import DEFAULT_MODEL
from tests.conftest import start_engine
from tests.inferlets.conftest import call

PROMPT = "Once upon a time, there was a little girl named Emma who loved to play"
SINKS, WINDOW, MAX = 4, 28, 120


@pytest.fixture(scope="module", params=["fp32", "int4"])
def edit_engine(request, pie_home):
    eng = start_engine(pie_home, [DEFAULT_MODEL], "--weights", request.param, "--pass-cost-rows", "0")
    yield eng
    eng.stop()


def test_streaming_llm_keeps_its_pages_flat_and_decodes_plainly_until_it_evicts(edit_engine):
    plain = call(edit_engine.address, "text-completion", prompt=PROMPT, max_tokens=MAX, ignore_eos=True)
    got = call(
        edit_engine.address,
        "streaming-llm",
        prompt=PROMPT,
        max_tokens=MAX,
        ignore_eos=True,
        sinks=SINKS,
        window=WINDOW,
    )
    s = got["stats"]
    page = 16
    budget = SINKS + WINDOW + page  # rows held before an eviction
    assert len(got["token_ids"]) == MAX and s["evictions"] >= (s["prompt_tokens"] + MAX - budget) // page
    assert s["kv_pages_max"] <= budget // page + 1 < plain["stats"]["kv_pages_max"]
    assert s["kv_rows"] < budget and s["kv_rows"] + s["evicted_rows"] == s["prompt_tokens"] + MAX - 1
    first_eviction = budget - s["prompt_tokens"]  # tokens picked before any row was dropped
    assert got["token_ids"][:first_eviction] == plain["token_ids"][:first_eviction]
    roomy = call(edit_engine.address, "streaming-llm", prompt=PROMPT, max_tokens=40, window=4096)
    short = call(edit_engine.address, "text-completion", prompt=PROMPT, max_tokens=40)
    assert roomy["token_ids"] == short["token_ids"] and roomy["stats"]["evictions"] == 0


def test_evicting_the_tail_continues_at_the_logical_length(edit_engine):
    """Rows dropped from the end, then the same tokens fired again: the continuation is the plain one, since the
    new rows sit at the positions the dropped ones had and attend the same keys."""

    async def go():
        session = await inferlet.connect(edit_engine.address)
        try:
            model = inferlet.model()
            ids = model.tokenizer.encode(PROMPT)
            ws = model.working_set()
            res = await inferlet.ForwardPass(ws).embed(ids).readout([len(ids) - 1], inferlet.Argmax()).submit()
            want = int(res.tokens[0])
            kept = await ws.evict(ranges=[(len(ids) - 3, len(ids))])
            assert (kept, ws.dropped, ws.position) == (len(ids) - 3, 3, len(ids))
            # positions: the 3 tokens again at their own positions, then the next token's row
            fp = inferlet.ForwardPass(ws).embed(ids[-3:], positions=range(len(ids) - 3, len(ids)))
            res = await fp.readout([2], inferlet.Argmax()).submit()
            await ws.release()
            return want, int(res.tokens[0]), ws.pages_max
        finally:
            session.client.close()

    want, got, pages = asyncio.run(go())
    assert got == want and pages >= 1
