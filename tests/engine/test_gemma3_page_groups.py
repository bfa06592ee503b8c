"""KV page groups on the real Gemma 3 270M (issue 56): the packaged Q4_K_M GGUF served in its default format
(``gguf``, the native step) with page groups (15 sliding layers keep their 512-row window's pages) and, on the
same weights, with every row kept (``--kv-swa-full``). Over a long Austen prompt the two give the same logits,
bit for bit, and so the same greedy tokens, through the prompt's chunks, decode, drafts accepted and rejected
(a deferred fold settled as a lookup drafter's would be), a fork mid-window, an eviction, and K/V saved from each
and appended into a fresh working set (continuing exactly), while an all-rows engine refuses rows a sliding one
let go of (``kv_mismatch``). The sliding groups hold about a window of pages; nothing is held after release.

In process (two ``EngineCore``s over one loaded model, as ``pie serve`` would run them in two engines), the model
linked from the user's store where it is imported. What the module costs is in docs/measurements-kv-groups.md."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from pie_runtime.engine.build import build_served_model
from pie_runtime.engine.core import EngineCore
from pie_runtime.engine.kv_pages import KVPages
from pie_runtime.engine.options import ServeOptions
from pie_runtime.engine.page_pool import PagePool
from pie_runtime.engine.runner import ModelRunner
from pie_runtime.engine.served import ServedModel
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol import messages as m
from pie_runtime.protocol.arrays import decode_array, encode_array
from pie_runtime.protocol.codec import pack, parse_request
from pie_runtime.store import ModelStore, import_model
from tests.drafter_fixtures import link_model

pytestmark = pytest.mark.e2e

MODEL, WINDOW, PAGE = "gemma3-270m", 512, 16
PROMPT = 4000
CORPUS = Path("/work/shared/corpus/austen.txt")
CLIENT = b"client"


def all_rows_twin(paged: ServedModel) -> ServedModel:
    """The same loaded weights over a pool that keeps every row of every layer (``--kv-swa-full``)."""
    cfg, kv = paged.runner.model.config, paged.runner.kv
    layout = KVCache.layout_of(cfg, 0, True)
    pool = KVCache(cfg, kv.num_pages, PAGE, kv.k.dtype, layout=layout)
    runner = ModelRunner(paged.runner.model, pool, torch.device("cpu"))
    info = paged.info.model_copy(update={"page_windows": list(layout.windows), "kv_bytes": pool.nbytes})
    pages = KVPages(PagePool(pool.num_pages), PAGE, runner.copy_pages, runner.copy_slots, layout.windows)
    return ServedModel(paged.name, info, runner, pages, paged.tokenizer_json)


class Core:
    def __init__(self, served: ServedModel):
        self.core = EngineCore([served], prefix_cache=False)
        self.served = served
        self.ids = iter(range(1, 1_000_000))

    def call(self, op: str, **fields) -> dict:
        _, req = parse_request(pack({"id": next(self.ids), "op": op, **fields}))
        reply = self.core.handle(CLIENT, req)
        assert reply is not None
        return reply

    def fire(self, ws: int, tokens: list[int], rows: list[int] | None = None, **fields) -> np.ndarray:
        """The logits of ``rows`` (default: the last) of a fire of ``tokens``."""
        rows = [len(tokens) - 1] if rows is None else rows
        req_id = next(self.ids)
        body = {"id": req_id, "op": "fire", "ws": ws, "tokens": tokens, "readouts": [{"rows": rows, "kind": "logits"}]}
        _, req = parse_request(pack({**body, **fields}))
        assert self.core.handle(CLIENT, req) is None
        replies: dict[int, dict] = {}
        while self.core.has_work():
            replies.update({r["id"]: r for _, r in self.core.step()})
        assert replies[req_id]["ok"], replies[req_id]
        return decode_array(replies[req_id]["results"][0]["logits"])

    def held(self, ws: int) -> list[int]:
        return self.served.pages.held_per_group(self.core.sets.get(CLIENT, ws))

    def read(self, ws: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[int]]:
        committed = self.core.sets.get(CLIENT, ws).committed
        chunks, start, held = [], 0, []
        while start < committed:
            reply = self.call("ws_read_kv", ws=ws, start=start, count=committed - start)
            chunks.append((decode_array(reply["k"]), decode_array(reply["v"])))
            start += chunks[-1][0].shape[2]
            held = reply["held_from"]
        return chunks, held

    def load(self, chunks, held: list[int], dropped: int) -> int:
        ws, start = self.call("ws_open")["ws"], 0
        for k, v in chunks:
            arrays = {"k": encode_array(k), "v": encode_array(v), "kv_dtype": self.served.info.kv_dtype}
            self.call("ws_append_kv", ws=ws, dropped=dropped, held_from=[max(0, h - start) for h in held], **arrays)
            start += k.shape[2]
        return ws


@pytest.fixture(scope="module")
def cores(tmp_path_factory) -> tuple[Core, Core]:
    home = tmp_path_factory.mktemp("gemma-home")
    store, user = ModelStore(home / "models"), ModelStore()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIE_HOME", str(home))
        if user.exists(MODEL):  # imported already (scripts/setup.sh): linked, read only
            link_model(user.path(MODEL), home / "models" / MODEL)
        else:
            import_model(MODEL, store=store, progress=False)
        paged = build_served_model(MODEL, ServeOptions(weights="gguf", kv_bytes=192 << 20), store=store)
    assert paged.info.page_windows == [None] + [WINDOW] * 5
    return Core(paged), Core(all_rows_twin(paged))


@pytest.fixture(scope="module")
def prompt(cores) -> list[int]:
    if not CORPUS.exists():
        pytest.skip(f"no corpus at {CORPUS}")
    tok = Tokenizer.from_str(cores[0].served.tokenizer_json)
    ids = [2] + tok.encode(CORPUS.read_text()[:40_000], add_special_tokens=False).ids  # BOS 2, as the model says
    assert len(ids) >= PROMPT
    return ids[:PROMPT]


def check_window_pages(c: Core, ws: int) -> None:
    """Each sliding group holds about its window: W / page and a page of slack, and the committed tail's page."""
    for window, held in zip(c.served.pages.windows, c.held(ws)):
        if window is not None:
            assert held <= window // PAGE + 2, c.held(ws)


def test_page_groups_give_the_all_rows_logits_through_every_operation(cores, prompt):
    paged, full = cores
    both = (paged, full)
    ws = {c: c.call("ws_open")["ws"] for c in both}

    def same(tokens: list[int], on: dict | None = None, **fields) -> np.ndarray:
        on = on or ws
        out = [c.fire(on[c], tokens, **fields) for c in both]
        assert np.array_equal(out[0], out[1])
        check_window_pages(paged, on[paged])
        return out[0]

    logits = same(prompt[:-1], rows=[0, WINDOW + 7, PROMPT - 2])  # the prompt in chunks; rows in and past a window
    last = int(logits[-1].argmax())
    greedy = []
    for _ in range(6):  # decode
        greedy.append(last)
        last = int(same([last])[-1].argmax())
    # a fork mid-window decodes ahead; its tokens are the parent's drafts, the first three kept, the rest wrong
    child = {c: c.call("ws_fork", ws=ws[c])["ws"] for c in both}
    ahead, t = [], last
    for _ in range(4):
        ahead.append(t)
        t = int(same([t], on=child)[-1].argmax())
    drafts = [*ahead, (t + 1) % 262144, 7]  # the last token, three right drafts, two wrong
    verify = same(drafts, rows=list(range(len(drafts))), fold=m.DEFERRED)
    kept = next(i for i in range(1, len(drafts)) if int(verify[i - 1].argmax()) != drafts[i])
    assert kept == 4  # the row and its three right drafts; the fourth draft is rejected
    last = int(verify[kept - 1].argmax())
    same([last], settle=kept)
    for c in both:  # an eviction of old rows (sinks kept): the window's rows are all kept
        committed = c.core.sets.get(CLIENT, ws[c]).committed
        c.call("ws_evict", ws=ws[c], ranges=[(4, committed - 2 * WINDOW)])
    for _ in range(4):
        last = int(same([last])[-1].argmax())
    greedy.append(last)
    # saved K/V: a sliding engine's into a fresh working set of a sliding engine, the all-rows engine's into both
    dropped = paged.core.sets.get(CLIENT, ws[paged]).dropped
    chunks, held = paged.read(ws[paged])
    assert held == [(h if w is not None else 0) for h, w in zip(held, paged.served.info.layer_windows)] and max(held)
    with pytest.raises(PieError) as e:
        full.load(chunks, held, dropped)
    assert e.value.code == ErrorCode.KV_MISMATCH
    loaded = {paged: paged.load(chunks, held, dropped)}
    full_chunks, full_held = full.read(ws[full])
    assert not any(full_held)
    loaded[full] = full.load(full_chunks, full_held, dropped)
    again = paged.load(full_chunks, full_held, dropped)
    check_window_pages(paged, again)
    for _ in range(3):
        want = same([last])
        assert np.array_equal(same([last], on=loaded), want)
        assert np.array_equal(paged.fire(again, [last]), want)
        last = int(want[-1].argmax())
    for c in both:
        for handle in (ws[c], child[c], loaded[c], *([again] if c is paged else [])):
            c.call("ws_release", ws=handle)
        assert c.served.pages.free == c.served.pages.total  # nothing leaked
