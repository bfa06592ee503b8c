"""The prefix cache (engine/prefix_cache.py): full committed KV pages named by a hash chain of their tokens,
kept idle when released, evicted least recently released first, and mapped copy-on-write by a new working
set's first fire.

In process (the tiny random Llama of test_core.py, no sockets): reuse, its limits, copy-on-write of a named
page, eviction, forks, departures and the stats. Over real engine processes (the default model): greedy output
is the same with and without the cache, for a second request sharing a system prompt, for forks (``n``), under
a speculative inferlet (cacheback) and under eviction in a small pool; a departed client's pages come back."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pie_runtime.engine.core import EngineCore
from pie_runtime.engine.page_pool import PagePool
from pie_runtime.engine.prefix_cache import PageChain, PrefixCache
from pie_runtime.launcher import EmbeddedEngine
from pie_runtime.protocol import messages as m
from pie_runtime.store import DEFAULT_MODEL
from tests.conftest import run, start_engine
from tests.engine.test_core import PAGE, PROMPT, A, B, Core, logits_of, tiny_served_model

LAST = [{"rows": [len(PROMPT) - 1], "kind": "logits"}]


def prefix_stats(c: Core) -> dict:
    return c.call(A, "stats")["models"]["tiny"]["prefix_cache"]


def kv_stats(c: Core) -> dict:
    return c.call(A, "stats")["models"]["tiny"]["kv"]


def prefill(c: Core, client: bytes, tokens: list[int], readouts: list | None = None, **fields) -> dict:
    """Opens a working set and fires ``tokens`` into it; the fire's reply, with the handle under ``ws``."""
    ws = c.call(client, "ws_open")["ws"]
    req = c.fire(client, ws, tokens, readouts=readouts or [], **fields)
    return {**c.run()[req], "ws": ws}


# ---- the page pool and the chain --------------------------------------------------------------------------


def test_idle_pages_count_free_and_are_evicted_least_recently_released_first():
    pool = PagePool(4)
    named = {0, 1}
    evicted: list[int] = []
    pool.keep = named.__contains__
    pool.on_evict = evicted.append
    a = pool.alloc(4)
    assert a == [0, 1, 2, 3] and pool.free_pages == 0
    pool.release([1, 0, 2, 3])  # 1 then 0 become idle; 2 and 3 are free
    assert pool.free_pages == 4 and pool.idle_pages == 2 and pool.used_pages == 0
    pool.share([0])  # a hit revives an idle page
    assert pool.refcount(0) == 1 and pool.idle_pages == 1
    assert sorted(pool.alloc(2)) == [2, 3] and evicted == []  # free pages go before idle ones
    assert pool.alloc(1) == [1] and evicted == [1] and pool.evictions == 1


def test_a_chain_names_only_full_committed_rows_and_stops_at_an_uncacheable_row():
    pool = PagePool(8)
    cache = PrefixCache(pool, 4, "m")
    chain = PageChain()
    pages = pool.alloc(3)
    chain.wrote(0, list(range(10)), 4)
    cache.register(chain, pages, committed=7)  # page 0 is full and committed, page 1 is not yet
    assert cache.cached_pages == 1 and len(chain.keys) == 1
    chain.wrote(10, None, 4)  # a row at an explicit position: not nameable
    chain.wrote(11, [1, 2], 4)  # past the gap: ignored
    cache.register(chain, pages, committed=12)
    assert cache.cached_pages == 2 and chain.tokens == list(range(10))
    keys, hit = cache.lookup(list(range(12)), max_rows=12)
    assert hit == pages[:2] and keys == chain.keys
    assert cache.lookup([9, *range(1, 12)], max_rows=12) == ([], [])  # another first page: another chain
    assert cache.lookup(list(range(12)), max_rows=7)[1] == pages[:1]  # never past max_rows


# ---- the engine core in process ---------------------------------------------------------------------------


def test_a_second_working_set_maps_the_cached_prefix_and_reads_the_same_logits():
    c = Core(num_pages=32)
    cold = prefill(c, A, PROMPT, LAST)
    assert cold["cached_rows"] == 0
    warm = prefill(c, B, PROMPT, LAST)
    assert warm["cached_rows"] == 28 and warm["committed"] == len(PROMPT)  # 7 full pages; the last row runs
    np.testing.assert_allclose(logits_of(warm), logits_of(cold), rtol=1e-5, atol=1e-5)
    assert prefix_stats(c) == {
        "enabled": True,
        "queries": 2,
        "hits": 1,
        "query_tokens": 60,
        "hit_tokens": 28,
        "cached_pages": 7,
        "evictions": 0,
    }
    kv = kv_stats(c)
    assert (kv["pages_used"], kv["pages_total"]) == (8 + 1, 32)  # B shares A's 7 named pages


def test_reuse_stops_before_a_row_a_readout_reads():
    c = Core()
    prefill(c, A, PROMPT)
    early = prefill(c, B, PROMPT, [{"rows": [9], "kind": "logits"}])
    assert early["cached_rows"] == 8
    ref = prefill(Core(), A, PROMPT, [{"rows": [9], "kind": "logits"}])
    np.testing.assert_allclose(logits_of(early), logits_of(ref), rtol=1e-5, atol=1e-5)
    assert prefill(c, B, PROMPT[:4], [{"rows": [3], "kind": "logits"}])["cached_rows"] == 0  # the last row runs


def test_explicit_positions_neither_reuse_nor_register():
    c = Core()
    rows = list(range(len(PROMPT)))
    assert prefill(c, A, PROMPT, positions=rows)["cached_rows"] == 0  # default positions, given explicitly
    assert prefill(c, A, PROMPT, positions=[p + 1 for p in rows])["cached_rows"] == 0  # shifted: no reuse
    assert prefill(c, A, PROMPT)["cached_rows"] == 7 * PAGE  # the first fire's pages were named
    fresh = Core()
    prefill(fresh, A, PROMPT, positions=[p + 1 for p in rows])
    assert prefix_stats(fresh)["cached_pages"] == 0
    assert prefill(fresh, B, PROMPT)["cached_rows"] == 0


def test_a_named_page_is_copied_before_a_write_so_the_cache_keeps_its_content():
    c = Core()
    first = prefill(c, A, PROMPT, LAST)
    assert c.call(A, "ws_truncate", ws=first["ws"], n=10) == {"committed": 10}  # inside named page 2
    c.fire(A, first["ws"], [5, 6, 7, 8, 9, 10])  # rewrites rows 10..15 of the truncated set
    c.run()
    again = prefill(c, B, PROMPT, LAST)
    assert again["cached_rows"] == 28
    np.testing.assert_allclose(logits_of(again), logits_of(first), rtol=1e-5, atol=1e-5)


def test_idle_pages_are_evicted_when_a_reserve_needs_them_and_outputs_stay_the_same():
    c = Core(num_pages=10)  # 40 rows
    first = prefill(c, A, PROMPT, LAST)  # 8 pages, 7 named
    c.call(A, "ws_release", ws=first["ws"])
    assert c.pages_free() == 10 and kv_stats(c)["pages_used"] == 0 and prefix_stats(c)["cached_pages"] == 7
    other = prefill(c, B, [(5 * i + 1) % 97 for i in range(36)])  # 9 pages: 3 free ones, then 6 idle evicted
    stats = prefix_stats(c)
    assert stats["evictions"] == 6 and stats["cached_pages"] == 1 + 9  # the chain's head was released last
    c.call(B, "ws_release", ws=other["ws"])
    again = prefill(c, A, PROMPT, LAST)
    assert again["cached_rows"] == PAGE and prefix_stats(c)["evictions"] == 6 + 7
    np.testing.assert_allclose(logits_of(again), logits_of(first), rtol=1e-5, atol=1e-5)


def test_a_fork_shares_its_parents_chain_and_names_its_own_pages():
    c = Core()
    parent = prefill(c, A, PROMPT[:20])
    child = c.call(A, "ws_fork", ws=parent["ws"])["ws"]
    c.fire(A, child, PROMPT[20:])
    c.run()
    assert prefix_stats(c)["cached_pages"] == 7  # 5 from the parent, 2 more the child filled
    warm = prefill(c, B, PROMPT, LAST)
    assert warm["cached_rows"] == 28
    np.testing.assert_allclose(logits_of(warm), logits_of(prefill(Core(), A, PROMPT, LAST)), rtol=1e-5, atol=1e-5)


def test_a_deferred_fold_names_pages_when_it_is_settled():
    c = Core()
    ws = c.call(A, "ws_open")["ws"]
    c.fire(A, ws, PROMPT, fold=m.DEFERRED)
    c.run()
    assert prefix_stats(c)["cached_pages"] == 0
    c.call(A, "ws_fold", ws=ws, n=13)
    assert prefix_stats(c)["cached_pages"] == 3  # rows 0..11; row 12 is committed but its page is not full


def test_two_cold_copies_of_a_prefix_name_one_and_free_the_other():
    c = Core(num_pages=32)
    wss = [c.call(A, "ws_open")["ws"] for _ in range(2)]
    reqs = [c.fire(A, ws, PROMPT) for ws in wss]  # both accepted before either ran: neither can reuse
    replies = c.run()
    assert [replies[r]["cached_rows"] for r in reqs] == [0, 0]
    assert prefix_stats(c)["cached_pages"] == 7 and kv_stats(c)["pages_used"] == 16
    for ws in wss:
        c.call(A, "ws_release", ws=ws)
    assert c.pages_free() == 32 and kv_stats(c)["pages_used"] == 0 and prefix_stats(c)["cached_pages"] == 7
    assert prefill(c, B, PROMPT)["cached_rows"] == 28


def test_departure_returns_every_page_and_keeps_the_named_ones_idle():
    c = Core(num_pages=16)
    prefill(c, A, PROMPT)
    prefill(c, A, PROMPT)
    assert kv_stats(c)["pages_used"] == 9
    assert c.core.drop_client(A) == 2
    assert kv_stats(c)["pages_used"] == 0 and c.pages_free() == 16
    assert prefix_stats(c)["cached_pages"] == 7


def test_without_the_cache_nothing_is_named_or_reused():
    core = EngineCore([tiny_served_model(32)], prefix_cache=False)
    c = Core()
    c.core = core
    prefill(c, A, PROMPT)
    assert prefill(c, B, PROMPT)["cached_rows"] == 0
    assert prefix_stats(c) == {
        "enabled": False,
        "queries": 0,
        "hits": 0,
        "query_tokens": 0,
        "hit_tokens": 0,
        "cached_pages": 0,
        "evictions": 0,
    }


# ---- real engine processes (the default model) ------------------------------------------------------------

SYSTEM = (
    "You are the harbour master of Wrenmouth, a small fishing town where a cold river meets a colder sea. "
    "You answer questions from visiting sailors about tides, moorings, the lighthouse, the fish market, the "
    "chandlery on Quay Street, the weather over the estuary and the rules of the harbour. You are brief, exact "
    "and polite, you never invent a rule, and when you do not know something you say so and name the office "
    "that would know. The harbour opens at dawn and closes at dusk; boats longer than twelve metres must book a "
    "berth a day ahead; the fuel pontoon takes cash and cards; the lighthouse shows two white flashes every ten "
    "seconds; the fish market sells from six until nine in the morning, and the chandlery closes on Sundays. "
)
QUESTIONS = ["When does the fish market open?", "How often does the lighthouse flash?", "Can I pay fuel by card?"]
POOL_PAGES = 40  # 640 rows: a few prompts fill it
# one torch thread: on a shared 2-core machine two threads an engine spin against the other processes
ENGINE_ARGS = ["--kv-pages", str(POOL_PAGES), "--pass-cost-rows", "0", "--threads", "1"]


@pytest.fixture(scope="module")
def engines(pie_home):
    """The default model served twice over a small pool: with the prefix cache and without it."""
    with ThreadPoolExecutor(2) as pool:  # the two start at once
        started = [
            pool.submit(start_engine, pie_home, [DEFAULT_MODEL], *ENGINE_ARGS, *extra)
            for extra in ([], ["--no-prefix-cache"])
        ]
        errors = [f.exception() for f in started]
    engines = [f.result() for f in started if f.exception() is None]
    if any(errors):
        for eng in engines:
            eng.stop()
        raise next(e for e in errors if e is not None)
    yield engines
    for eng in engines:
        eng.stop()


async def _session(address: str):
    import inferlet

    session = await inferlet.connect(address)
    return session, session.model()


def stats_of(eng: EmbeddedEngine) -> dict:
    async def go() -> dict:
        session, model = await _session(eng.address)
        try:
            return (await session.client.request("stats"))["models"][model.name]
        finally:
            session.client.close()

    return asyncio.run(go())


def chat_ids(eng: EmbeddedEngine, prompt: str) -> list[int]:
    """The prompt's ids as ``text-completion --chat`` renders them."""
    from inferlet.text.arguments import CompletionArgs

    async def go() -> list[int]:
        session, model = await _session(eng.address)
        session.client.close()
        return CompletionArgs(prompt=prompt, chat=True).prompt_ids(model.tokenizer)

    return asyncio.run(go())


def greedy(eng: EmbeddedEngine, ids: list[int], tokens: int = 8) -> tuple[list[int], int]:
    """Prefills ``ids`` in a fresh working set and decodes ``tokens`` greedily, in this process; returns the
    tokens and the rows the engine took from its prefix cache. ``tokens=0`` only prefills."""
    import inferlet

    async def go() -> tuple[list[int], int]:
        session, model = await _session(eng.address)
        ws = model.working_set()
        try:
            fp = inferlet.ForwardPass(ws).embed(ids)
            if tokens:
                fp.readout([len(ids) - 1], inferlet.Argmax())
            res = await fp.submit()
            out = [int(res.tokens[0])] if tokens else []
            while 0 < len(out) < tokens:
                res = await inferlet.ForwardPass(ws).embed(out[-1:]).readout([0], inferlet.Argmax()).submit()
                out.append(int(res.tokens[0]))
            return out, ws.cached_rows
        finally:
            await ws.release()
            session.client.close()

    return asyncio.run(go())


def complete(eng: EmbeddedEngine, prompt: str, *words: str, inferlet: str = "text-completion") -> dict:
    return run(inferlet, eng.address, "--prompt", prompt, "--max-tokens", "8", "--chat", *words)


def test_a_request_sharing_a_system_prompt_reuses_it_and_answers_the_same(engines):
    cached, plain = engines
    first, second = (chat_ids(cached, SYSTEM + q) for q in QUESTIONS[:2])
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    before = stats_of(cached)["prefix_cache"]
    answers = [greedy(cached, first), greedy(cached, second)]
    after = stats_of(cached)["prefix_cache"]
    assert answers[1][1] == shared // 16 * 16 > 0  # every full page of the shared prefix
    assert after["queries"] - before["queries"] == 2 and after["hits"] - before["hits"] >= 1
    assert after["hit_tokens"] - before["hit_tokens"] >= answers[1][1]
    assert [a for a, _ in answers] == [greedy(plain, first)[0], greedy(plain, second)[0]]
    off = stats_of(plain)["prefix_cache"]
    assert off["enabled"] is False and off["queries"] == off["cached_pages"] == 0  # --no-prefix-cache


def test_forks_and_cacheback_answer_the_same_with_and_without_reuse(engines):
    cached, plain = engines
    prompt = SYSTEM + QUESTIONS[2]
    greedy(cached, chat_ids(cached, prompt)[:-1], tokens=0)  # the prompt's pages, named
    forks = complete(cached, prompt, "--n", "3")
    assert forks["stats"]["cached_tokens"] > 0
    assert [c["token_ids"] for c in forks["choices"]] == [
        c["token_ids"] for c in complete(plain, prompt, "--n", "3")["choices"]
    ]
    spec = ("--draft-schedule", "fixed", "--draft-length", "4")
    lookup = "cacheback-speculative-decoding"
    greedy(cached, chat_ids(cached, SYSTEM + SYSTEM)[:-1], tokens=0)
    looked = complete(cached, SYSTEM + SYSTEM, *spec, inferlet=lookup)
    assert looked["stats"]["cached_tokens"] > 0
    assert looked["token_ids"] == complete(plain, SYSTEM + SYSTEM, *spec, inferlet=lookup)["token_ids"]


def test_a_small_pool_evicts_idle_pages_and_answers_stay_the_same(engines):
    cached, plain = engines
    ids = chat_ids(cached, SYSTEM + QUESTIONS[0])
    evictions = stats_of(cached)["prefix_cache"]["evictions"]
    for i in range(1, 5):  # other prompts of ~200 tokens, from their first page on: more than the pool holds
        greedy(cached, [*range(1000 * i, 1000 * i + 8), *ids[8:]], tokens=0)
    stats = stats_of(cached)
    assert stats["prefix_cache"]["evictions"] > evictions
    assert (stats["kv"]["pages_used"], stats["kv"]["pages_total"]) == (0, POOL_PAGES)
    assert stats["pages_free"] == POOL_PAGES
    assert greedy(cached, ids)[0] == greedy(plain, ids)[0]


async def hold_and_vanish(address: str, text: str) -> int:
    """Prefills ``text`` into two working sets and closes the connection without releasing them; returns the
    pages they held."""
    import inferlet

    session, model = await _session(address)
    ids = model.tokenizer.encode(text)
    for _ in range(2):
        await inferlet.ForwardPass(model.working_set()).embed(ids).submit()
    held = (await session.client.request("stats"))["models"][model.name]["kv"]["pages_used"]
    session.client.close()
    return held


def test_a_departed_clients_pages_come_back(engines):
    cached, _ = engines
    assert asyncio.run(hold_and_vanish(cached.address, SYSTEM)) > 0
    deadline = time.monotonic() + 60
    while (stats := stats_of(cached))["kv"]["pages_used"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats["kv"]["pages_used"] == 0 and stats["pages_free"] == POOL_PAGES
    assert stats["prefix_cache"]["cached_pages"] > 0  # kept idle, for the next request that shares them
