"""KV edits on the real default model in its default format (int4, the native step), across engine processes:
a long streaming-llm generation holds as many pages at its end as at its first eviction whatever its length;
an eviction gives the engine's pool exactly the pages it reports freed (engine stats); a fork of an edited working
set and the set itself, each edited further, decode what the same edits decode without a fork; an edited set
saved by one engine continues in another exactly as in the first (greedy tokens); a bad edit is a typed error
that changes nothing."""

from __future__ import annotations

import pytest

import inferlet
from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.store import DEFAULT_MODEL
from tests.conftest import in_session, pages_free, start_engine
from tests.inferlets.conftest import call

PROMPT = "Once upon a time, there was a little girl named Emma who loved to play in the garden with her dog. " * 8
SHORT = "Once upon a time, there was a little girl named Emma who loved to play"
SINKS, PAGE = 4, 16
STEPS = 8


@pytest.fixture(scope="module")
def engines(pie_home):
    first, second = (
        start_engine(pie_home, [DEFAULT_MODEL], "--weights", "int4", "--pass-cost-rows", "0") for _ in "ab"
    )
    yield first, second
    first.stop()
    second.stop()


async def greedy(ws: inferlet.WorkingSet, window: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens: fire ``window``, then each picked token."""
    out: list[int] = []
    for _ in range(steps):
        res = await inferlet.ForwardPass(ws).embed(window).readout([len(window) - 1], inferlet.Argmax()).submit()
        out.append(int(res.tokens[0]))
        window = out[-1:]
    return out


async def edited(model: inferlet.Model, ids: list[int], *cuts: tuple[int, int]) -> inferlet.WorkingSet:
    """A working set holding ``ids`` but the last, with the row ``ranges`` ``cuts`` evicted one after another."""
    ws = model.working_set()
    await inferlet.ForwardPass(ws).embed(ids[:-1]).submit()
    for cut in cuts:
        await ws.evict(ranges=[cut])
    return ws


def test_a_long_streaming_llm_generation_holds_a_constant_number_of_pages(engines):
    """The window is short (the issue's 4,000 tokens at W=256 take too long for the suite on a shared 2-core
    machine): what matters is that once the window has filled, a generation 2.6x longer holds no more pages."""
    window = 32
    args = dict(prompt=SHORT, ignore_eos=True, sinks=SINKS, window=window)
    short = call(engines[0].address, "streaming-llm", max_tokens=100, **args)["stats"]
    long = call(engines[0].address, "streaming-llm", max_tokens=260, **args)["stats"]
    budget = -(-(SINKS + window + PAGE) // PAGE)  # pages of the rows held right before an eviction
    for s in (short, long):
        assert s["kv_rows"] + s["evicted_rows"] == s["prompt_tokens"] + s["generated_tokens"] - 1
        assert s["kv_pages_max"] == budget and s["kv_pages"] in (budget - 1, budget)
    assert long["evictions"] > 2 * short["evictions"] >= 8
    assert long["prompt_tokens"] + 260 > 4 * budget * PAGE  # without evictions it would hold 4x the pages


def test_an_eviction_gives_the_pool_the_pages_it_reports(engines):
    async def body(model):
        ids = model.tokenizer.encode(PROMPT)
        free0 = await pages_free(model)
        edits0 = (await model.client.request("stats"))["models"][model.name]["kv"]
        ws = await edited(model, ids)
        held, free1 = ws.pages, await pages_free(model)
        reply = await model.client.request("ws_evict", ws=await ws.handle(), rows=[], ranges=[[SINKS, 9 * PAGE]])
        free2 = await pages_free(model)
        edits = (await model.client.request("stats"))["models"][model.name]["kv"]
        await ws.release()
        return ids, free0, held, free1, reply, free2, edits0, edits, await pages_free(model)

    ids, free0, held, free1, reply, free2, edits0, edits, free3 = in_session(engines[0].address, body)
    assert free1 == free0 - held and reply["freed"] == held - reply["pages"] >= 8
    assert free2 == free1 + reply["freed"] and free3 == free0
    assert edits["evicted_rows"] - edits0["evicted_rows"] == 9 * PAGE - SINKS
    assert edits["evicted_pages"] - edits0["evicted_pages"] == reply["freed"]


def test_a_fork_of_an_edited_set_and_the_set_each_decode_as_unforked(engines):
    cut, more = (SINKS, 4 * PAGE), (SINKS, SINKS + 20)

    async def body(model):
        ids = model.tokenizer.encode(PROMPT)
        parent = await edited(model, ids, cut)
        child = await parent.fork()
        await child.evict(ranges=[more])
        got_parent, got_child, window = [], [], ids[-1:]
        for _ in range(STEPS):  # interleaved: each step writes its own tail page, never the other's
            got_parent += await greedy(parent, got_parent[-1:] or window, 1)
            got_child += await greedy(child, got_child[-1:] or window, 1)
        want_parent = await greedy(await edited(model, ids, cut), window, STEPS)
        want_child = await greedy(await edited(model, ids, cut, more), window, STEPS)
        return got_parent, got_child, want_parent, want_child

    got_parent, got_child, want_parent, want_child = in_session(engines[0].address, body)
    assert got_parent == want_parent and got_child == want_child
    assert want_parent != want_child  # the further edit changed what the fork attends to


def test_an_edited_set_saved_by_one_engine_continues_alike_in_another(engines, tmp_path):
    path = str(tmp_path / "edited.kv")

    async def save(model):
        ids = model.tokenizer.encode(PROMPT)
        ws = await edited(model, ids, (SINKS, 5 * PAGE + 3))
        kept = ids[:SINKS] + ids[5 * PAGE + 3 : -1]
        saved = await ws.save(path, tokens=kept, pending=ids[-1:])
        return saved.dropped, await greedy(ws, ids[-1:], STEPS)

    async def load(model):
        ws, saved = await model.load_working_set(path)
        return ws.position, await greedy(ws, saved.pending, STEPS)

    dropped, want = in_session(engines[0].address, save)
    position, got = in_session(engines[1].address, load)
    ids = call(engines[1].address, "text-completion", prompt=PROMPT, max_tokens=1)["stats"]["prompt_tokens"]
    assert dropped == 5 * PAGE + 3 - SINKS and position == ids - 1
    assert got == want


def test_a_bad_edit_is_typed_and_changes_nothing(engines):
    async def body(model):
        ids = model.tokenizer.encode(PROMPT)
        ws = await edited(model, ids)
        before = (ws.committed, ws.pages, await pages_free(model))
        codes = []
        for rows, ranges in (([len(ids)], ()), ((), [(0, len(ids) + 5)]), ([-1], ())):
            try:
                await ws.evict(rows=rows, ranges=ranges)
            except (PieError, ValueError) as e:
                codes.append(getattr(e, "code", "invalid"))
        after = (ws.committed, ws.pages, await pages_free(model))
        tokens = await greedy(ws, ids[-1:], 4)
        await ws.release()
        plain = await greedy(await edited(model, ids), ids[-1:], 4)
        return codes, before, after, tokens, plain

    codes, before, after, tokens, plain = in_session(engines[0].address, body)
    assert codes[:2] == [ErrorCode.ROW_OUT_OF_RANGE, ErrorCode.ROW_OUT_OF_RANGE] and len(codes) == 3
    assert after == before and tokens == plain
