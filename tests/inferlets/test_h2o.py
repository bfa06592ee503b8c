"""The h2o inferlet (inferlets/h2o.py) on the real default model: with a budget above the sequence it decodes
text-completion's tokens; with a small budget its pages stay bounded over a long generation; and an eviction keeps
exactly the recent rows and the rows of highest accumulated attention mass, tallied here from the readouts
themselves and checked on the K the engine holds after it (every kept row's K, bit for bit)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from dataclasses import dataclass

import numpy as np
import pytest

import inferlet
from pie_runtime.protocol import decode_array
from pie_runtime.store import DEFAULT_MODEL
from tests.conftest import start_engine
from tests.inferlets.conftest import INFERLETS, call

PROMPT = "Once upon a time, there was a little girl named Emma who loved to play in the garden with her dog Max."


@dataclass(frozen=True)
class Served:
    address: str
    format: str  # the weight format the engine serves


@pytest.fixture(scope="module", params=["fp32", "int4"])
def h2o_engine(request, pie_home):
    eng = start_engine(pie_home, [DEFAULT_MODEL], "--weights", request.param, "--pass-cost-rows", "0")
    yield Served(eng.address, request.param)
    eng.stop()


def h2o_module():
    spec = importlib.util.spec_from_file_location("inferlet_h2o", INFERLETS / "h2o.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as the SDK's runtime loads it: pydantic resolves Args' annotations there
    spec.loader.exec_module(module)
    return module


def test_a_budget_above_the_sequence_decodes_text_completions_tokens(h2o_engine):
    plain = call(h2o_engine.address, "text-completion", prompt=PROMPT, max_tokens=40, ignore_eos=True)
    got = call(h2o_engine.address, "h2o", prompt=PROMPT, max_tokens=40, ignore_eos=True, budget=4096, prefill_chunk=7)
    assert got["token_ids"] == plain["token_ids"] and got["stats"]["evictions"] == 0


def test_a_small_budget_keeps_the_pages_bounded(h2o_engine):
    if h2o_engine.format == "fp32":
        pytest.skip("one format is enough for a long generation's page count")
    budget, max_tokens = 64, 400
    got = call(h2o_engine.address, "h2o", prompt=PROMPT, max_tokens=max_tokens, ignore_eos=True, budget=budget)
    s = got["stats"]
    page = 16
    assert len(got["token_ids"]) == max_tokens
    assert s["kv_pages_max"] <= (budget + page) // page + 1 and s["kv_rows"] < budget + page
    assert s["kv_rows"] + s["evicted_rows"] == s["prompt_tokens"] + max_tokens - 1
    assert s["evictions"] >= (s["prompt_tokens"] + max_tokens - budget - page) // page


async def read_k(model, ws) -> np.ndarray:
    reply = await model.client.request("ws_read_kv", ws=await ws.handle(), start=0, count=ws.committed)
    return decode_array(reply["k"])  # (layers, kv_heads, rows, head_dim)


def test_an_eviction_keeps_the_recent_rows_and_the_heaviest_hitters(h2o_engine):
    budget, recent, chunk = 24, 8, 8
    policy = h2o_module().HeavyHitters(budget, recent, chunk)

    async def body(model) -> int:
        ids = model.tokenizer.encode(PROMPT)
        ws = model.working_set()
        origin: list[int] = []  # each row's index in the sequence as written
        mass: dict[int, float] = {}  # the mass each row received so far, tallied here
        window, trims, written = ids, 0, 0
        for _ in range(40):
            fp = inferlet.ForwardPass(ws).embed(window).readout([len(window) - 1], inferlet.Argmax())
            res = await fp.readout(range(len(window)), inferlet.AttentionScores()).submit()
            scores = res.readouts[1].scores
            origin += range(written, written + len(window))
            written += len(window)
            for j, row in enumerate(origin):
                mass[row] = mass.get(row, 0.0) + float(scores[:, j].sum(dtype=np.float64))
            policy.observe(scores)
            before = await read_k(model, ws)
            await policy.trim(ws)
            if ws.committed < len(origin):  # it evicted: the recent rows and the heaviest others stay
                older = origin[:-recent]
                heavy = sorted(sorted(older, key=lambda r: -mass[r])[: budget - recent])
                kept = [origin.index(r) for r in heavy] + list(range(len(origin) - recent, len(origin)))
                assert np.array_equal(await read_k(model, ws), before[:, :, kept])
                origin = [origin[i] for i in kept]
                trims += 1
            window = [int(res.readouts[0].tokens[0])]
        await ws.release()
        return trims

    async def go():
        session = await inferlet.connect(h2o_engine.address)
        try:
            return await body(inferlet.model())
        finally:
            session.client.close()

    assert asyncio.run(go()) >= 3
