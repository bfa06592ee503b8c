"""KV page groups per attention kind (issue 56; models/kv_groups.py, engine/kv_pages.py), in process on random
sliding-window models: a Mistral-shaped one (every layer slides) and a Gemma-shaped mix (three sliding layers,
one global: four page groups of one layer). A core whose sliding groups let go of the rows that left their
window gives the logits, bit for bit, of a core of the same weights that keeps every row (``swa_full``, as
``--kv-swa-full``) through prefill, decode, rejected and accepted drafts, a tree window, a fork mid-window, an
eviction and a save in one core loaded into another (refused where the rows it lacks would be needed), and the
attention readout (a sliding layer's mass on its window's keys only); the sliding groups hold at most
W / page + 2 pages; and every page is back when the working sets are released."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pie_runtime.engine.core import EngineCore
from pie_runtime.engine.kv_pages import KVPages
from pie_runtime.engine.page_pool import PagePool
from pie_runtime.engine.runner import ModelRunner
from pie_runtime.engine.served import ServedModel
from pie_runtime.engine.working_set import WorkingSet
from pie_runtime.models.config import ModelConfig
from pie_runtime.models.context import Segment
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.kv_groups import KVLayout, group_pages_bound
from pie_runtime.models.llama import LlamaForCausalLM
from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol import messages as m
from pie_runtime.protocol.arrays import decode_array, encode_array
from pie_runtime.protocol.codec import pack, parse_request

VOCAB, PAGE, WINDOW, PAGES = 97, 4, 12, 96
A = b"client-a"
LOGITS = [{"rows": [0], "kind": "logits"}]
SHAPES = {
    "mistral": None,
    "gemma": ("sliding_attention", "sliding_attention", "sliding_attention", "full_attention"),
}


def served(shape: str, swa_full: bool, page: int = PAGE) -> ServedModel:
    torch.manual_seed(0)
    types = SHAPES[shape]
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4 if types else 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        sliding_window=WINDOW,
        layer_types=types,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    layout = KVCache.layout_of(cfg, 0, swa_full)
    kv = KVCache(cfg, PAGES, page, torch.float32, layout=layout)
    runner = ModelRunner(model, kv, torch.device("cpu"))
    info = m.ModelInfo(
        name="tiny",
        vocab_size=VOCAB,
        max_positions=512,
        page_size=page,
        bos_token_id=None,
        eos_token_ids=[],
        chat_template=None,
    )
    pages = KVPages(PagePool(PAGES), page, runner.copy_pages, runner.copy_slots, layout.windows)
    return ServedModel("tiny", info, runner, pages, "{}")


class Core:
    def __init__(self, shape: str, swa_full: bool, max_batch_tokens: int = 256, page: int = PAGE):
        self.core = EngineCore([served(shape, swa_full, page)], max_batch_tokens)
        self.ids = iter(range(1, 1_000_000))

    def call(self, op: str, **fields) -> dict:
        _, req = parse_request(pack({"id": next(self.ids), "op": op, **fields}))
        reply = self.core.handle(A, req)
        assert reply is not None
        return reply

    def fire(self, ws: int, tokens: list[int], **fields) -> dict:
        req_id = next(self.ids)
        _, req = parse_request(pack({"id": req_id, "op": "fire", "ws": ws, "tokens": tokens, **fields}))
        assert self.core.handle(A, req) is None
        replies: dict[int, dict] = {}
        while self.core.has_work():
            replies.update({r["id"]: r for _, r in self.core.step()})
        assert replies[req_id]["ok"], replies[req_id]
        return replies[req_id]

    def logits(self, ws: int, tokens: list[int], **fields) -> np.ndarray:
        rows = [{"rows": list(range(len(tokens))), "kind": "logits"}]
        return decode_array(self.fire(ws, tokens, readouts=rows, **fields)["results"][0]["logits"])

    @property
    def pages(self) -> KVPages:
        return self.core.models["tiny"].pages

    def held(self, ws: int) -> list[int]:
        return self.pages.held_per_group(self.core.sets.get(A, ws))


def token(i: int) -> int:
    return (7 * i + 3) % VOCAB


def check_bounded(c: Core, ws: int) -> None:
    """Every sliding group holds at most W / page + 2 pages (one of slack, one the committed tail may open)."""
    for window, held in zip(c.pages.windows, c.held(ws)):
        if window is not None:
            assert held <= window // PAGE + 2, (window, held)


@pytest.mark.parametrize("shape", ["mistral", "gemma"])
def test_the_window_pages_give_the_all_rows_logits_through_every_operation(shape):
    paged, full = Core(shape, False), Core(shape, True)
    assert len(full.pages.windows) == 1 and full.pages.windows[0] is None
    assert paged.pages.windows == ((WINDOW,) if shape == "mistral" else (None, WINDOW, WINDOW, WINDOW))
    ws = {c: c.call("ws_open")["ws"] for c in (paged, full)}

    def same(tokens: list[int], **fields) -> None:
        out = [c.logits(ws[c], tokens, **fields) for c in (paged, full)]
        assert np.array_equal(out[0], out[1])
        check_bounded(paged, ws[paged])

    same([token(i) for i in range(30)])  # a prefill past the window
    for i in range(30, 60):  # decode
        same([token(i)])
    same([token(i) for i in range(60, 64)], fold=1)  # drafts: one accepted, three rejected
    same([token(i) for i in range(61, 65)], fold=m.DEFERRED)  # a deferred fold settled by the next fire
    same([token(65)], settle=4)
    same([token(66), token(67), token(68)], parents=[-1, 0, 0], fold=[0, 2])  # a tree window, its second branch
    children = {c: c.call("ws_fork", ws=ws[c])["ws"] for c in (paged, full)}  # a fork mid-window
    for i in range(70, 80):
        out = [c.logits(children[c], [token(i)]) for c in (paged, full)]
        assert np.array_equal(out[0], out[1])
        same([token(i + 100)])
    for c in (paged, full):  # an eviction of rows long before the window: sinks + recent rows
        committed = c.core.sets.get(A, ws[c]).committed
        c.call("ws_evict", ws=ws[c], ranges=[(4, committed - 20)])
    for i in range(80, 100):
        same([token(i)])
    for c in (paged, full):
        for handle in (ws[c], children[c]):
            c.call("ws_release", ws=handle)
        assert c.pages.free == PAGES  # nothing leaked


def test_the_attention_readout_reads_only_the_rows_each_layer_attends():
    """Past the window, a sliding layer's attention mass (read through its page group, whose early pages are gone)
    lies on its window's keys only, the global layer's on every earlier row; summed or per layer, the scores are
    the all-rows core's bit for bit, at a decode row and at a verify window's rows."""
    paged, full = Core("gemma", False), Core("gemma", True)
    ws = {c: c.call("ws_open")["ws"] for c in (paged, full)}
    for c in (paged, full):
        c.fire(ws[c], [token(i) for i in range(40)])
    for per_layer in (True, False):
        for tokens, rows in (([token(40)], [0]), ([token(41), token(42), token(43)], [0, 2])):
            readouts = [{"rows": rows, "kind": "attention", "per_layer": per_layer}]
            got = [
                decode_array(c.fire(ws[c], tokens, readouts=readouts, fold=0)["results"][0]["scores"])
                for c in (paged, full)
            ]
            assert np.array_equal(got[0], got[1])
            if per_layer:
                for r, row in enumerate(rows):
                    query = 40 + row  # the row's sequence index (fold=0: the fires commit nothing)
                    for layer, kind in enumerate(SHAPES["gemma"] or ()):
                        mass = got[0][r, layer]
                        first = query - WINDOW + 1 if kind == "sliding_attention" else 0
                        assert np.all(mass[:first] == 0) and np.all(mass[first : query + 1] > 0)
                        assert np.all(mass[query + 1 :] == 0)
                        assert abs(float(mass.sum()) - 4.0) < 1e-4  # the query heads' count
    check_bounded(paged, ws[paged])
    assert paged.held(ws[paged])[1] < full.held(ws[full])[0]  # the sliding groups did let go of pages


@pytest.mark.parametrize("shape", ["mistral", "gemma"])
def test_a_long_prompts_sliding_pages_move_along_its_chunks(shape):
    """A 120-row prompt run 8 rows a step: its sliding groups never hold more than a window and a chunk of pages
    (``KVPages.window_span``), nor, through decode and verify windows, more than admission charges
    (``group_pages_bound``); its logits are the all-rows core's."""
    paged, full = Core(shape, False, max_batch_tokens=8), Core(shape, True, max_batch_tokens=8)
    ws = {c: c.call("ws_open")["ws"] for c in (paged, full)}
    prompt = [token(i) for i in range(120)]
    out = [c.logits(ws[c], prompt[:2]) for c in (paged, full)]  # a start that is not page-aligned
    assert np.array_equal(out[0], out[1])
    readout = [{"rows": [0, 50, 117], "kind": "logits"}]
    span = paged.pages.window_span(WINDOW) // PAGE + 1
    most = [0] * len(paged.pages.windows)
    for c in (paged, full):
        req_id = next(c.ids)
        _, req = parse_request(
            pack({"id": req_id, "op": "fire", "ws": ws[c], "tokens": prompt[2:], "readouts": readout})
        )
        assert c.core.handle(A, req) is None
        replies: dict[int, dict] = {}
        while c.core.has_work():
            replies.update({r["id"]: r for _, r in c.core.step()})
            if c is paged:
                most = [max(m, h) for m, h in zip(most, paged.held(ws[c]))]
        out.append(decode_array(replies[req_id]["results"][0]["logits"]))
    assert np.array_equal(out[2], out[3])
    for window, held in zip(paged.pages.windows, most):
        assert held <= (span if window is not None else 122 // PAGE + 1)
    check_bounded(paged, ws[paged])
    for i in range(122, 130):
        a, b = paged.logits(ws[paged], [token(i)]), full.logits(ws[full], [token(i)])
        assert np.array_equal(a, b)
        drafts = [token(i + 1), token(i + 2), token(i + 3)]  # a verify window past the committed rows, rejected
        a, b = paged.logits(ws[paged], drafts, fold=0), full.logits(ws[full], drafts, fold=0)
        assert np.array_equal(a, b)
        most = [max(m, h) for m, h in zip(most, paged.held(ws[paged]))]
    # what admission charges a run of these rows (serve/auth.py kv_needed) bounds what each group held
    for window, held in zip(paged.pages.windows, most):
        assert held <= group_pages_bound(133, window, PAGE, 8)
    paged.call("ws_release", ws=ws[paged])
    assert paged.pages.free == PAGES


def read_all(c: Core, ws: int, rows: int) -> tuple[list[tuple[Any, Any]], dict]:
    chunks, start = [], 0
    while start < rows:
        reply = c.call("ws_read_kv", ws=ws, start=start, count=rows - start)
        chunks.append((decode_array(reply["k"]), decode_array(reply["v"])))
        start += chunks[-1][0].shape[2]
    return chunks, reply


def append_all(c: Core, ws: int, chunks, held_from: list[int]) -> None:
    start = 0
    for k, v in chunks:
        rel = [max(0, h - start) for h in held_from]
        c.call("ws_append_kv", ws=ws, k=encode_array(k), v=encode_array(v), kv_dtype="float32", held_from=rel)
        start += k.shape[2]


def test_saved_rows_load_where_their_layout_lets_them_continue_exactly():
    """Rows read from a sliding core name, per layer, the first row they hold: they load into a sliding core (of
    another page size too, which then refuses a truncation needing a row the sender had let go of) and continue
    exactly; an all-rows core refuses them (kv_mismatch, nothing changed); rows read from an all-rows core load
    into a sliding one."""
    paged, full, wide = Core("gemma", False), Core("gemma", True), Core("gemma", False, page=8)
    src = paged.call("ws_open")["ws"]
    paged.logits(src, [token(i) for i in range(50)])
    chunks, reply = read_all(paged, src, 50)
    assert reply["layer_windows"] == [WINDOW, WINDOW, WINDOW, None]
    first = (50 - WINDOW + 1) // PAGE * PAGE  # the first row of the page holding the window's first row
    assert reply["held_from"] == [first, first, first, 0]
    dst = full.call("ws_open")["ws"]
    with pytest.raises(PieError) as e:
        append_all(full, dst, chunks, reply["held_from"])
    assert e.value.code == ErrorCode.KV_MISMATCH and "--kv-swa-full" in str(e.value)
    assert full.core.sets.get(A, dst).committed == 0 and full.pages.free == PAGES - 0
    back = wide.call("ws_open")["ws"]  # pages of 8 rows: its page 4 (rows 32..39) holds rows the file lacks
    append_all(wide, back, chunks, reply["held_from"])
    assert wide.core.sets.get(A, back).held_from == first
    held = wide.pages.held_from(wide.core.sets.get(A, back))
    assert held[1:] == [first] * 3 and held[0] == 0
    with pytest.raises(PieError) as e:  # its window would need row first - 1: zeros here, not the sender's row
        wide.call("ws_truncate", ws=back, n=first - 1 + WINDOW - 1)
    assert e.value.code == ErrorCode.UNSUPPORTED
    ref = wide.call("ws_open")["ws"]  # the same rows computed in this core: the bits to continue with
    wide.logits(ref, [token(i) for i in range(50)])
    for c, ws in ((paged, src), (wide, back), (wide, ref)):
        c.call("ws_truncate", ws=ws, n=first + WINDOW - 1)  # the window from the sender's first held row: fine
    fork = wide.call("ws_fork", ws=back)["ws"]
    assert wide.core.sets.get(A, fork).held_from == first
    for i in range(50, 70):
        a, b, c = wide.logits(ref, [token(i)]), wide.logits(back, [token(i)]), wide.logits(fork, [token(i)])
        assert np.array_equal(a, b) and np.array_equal(a, c)
        assert np.allclose(paged.logits(src, [token(i)]), a, atol=1e-5)  # another page size: another sum order
    whole = full.call("ws_open")["ws"]  # rows an all-rows core held load into a sliding core
    full.logits(whole, [token(i) for i in range(50)])
    chunks, reply = read_all(full, whole, 50)
    assert reply["held_from"] == [0, 0, 0, 0]
    into = paged.call("ws_open")["ws"]
    append_all(paged, into, chunks, reply["held_from"])
    check_bounded(paged, into)
    for i in range(50, 60):
        assert np.array_equal(full.logits(whole, [token(i)]), paged.logits(into, [token(i)]))


def test_an_edit_that_needs_rows_a_sliding_group_let_go_is_refused_and_changes_nothing():
    c = Core("mistral", False)
    ws = c.call("ws_open")["ws"]
    c.logits(ws, [token(i) for i in range(40)])
    held = c.held(ws)
    with pytest.raises(PieError) as e:
        c.call("ws_truncate", ws=ws, n=20)
    assert e.value.code == ErrorCode.UNSUPPORTED
    with pytest.raises(PieError) as e:  # drops the window's rows: earlier rows would enter it
        c.call("ws_evict", ws=ws, ranges=[(30, 40)])
    assert e.value.code == ErrorCode.UNSUPPORTED
    assert c.core.sets.get(A, ws).committed == 40 and c.held(ws) == held
    stats = c.call("stats")["models"]["tiny"]
    assert stats["page_groups"] == [{"window": WINDOW, "pages": sum(held)}]


def test_the_layout_groups_kinds_in_pages_of_equal_layers():
    gemma = KVLayout.of([WINDOW] * 5 + [None] + [WINDOW] * 5 + [None] + [WINDOW] * 5 + [None])
    assert gemma.unit == 3 and gemma.windows == (None,) + (WINDOW,) * 5
    assert gemma.layer_group[5] == 0 and gemma.layer_group[:5] == (1, 1, 1, 2, 2)
    assert KVLayout.of([None, None]) == KVLayout.single(2)
    full = KVLayout.of([WINDOW, None], swa_full=True)
    assert full.windows == (None,) and full.layer_window == (WINDOW, None)


def hf_model(family: str, head_dim: int = 16):
    import transformers

    torch.manual_seed(0)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
        sliding_window=16,
    )
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(num_hidden_layers=2, **common)).eval()
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # 4 sliding, 2 global: pages of 2
    cfg = transformers.Gemma3TextConfig(num_hidden_layers=6, layer_types=types, query_pre_attn_scalar=16, **common)
    return transformers.Gemma3ForCausalLM(cfg).eval()


def run_window_pages(model, cfg, swa_full: bool, ids: list[int]) -> tuple[torch.Tensor, KVPages, WorkingSet]:
    """Prefill 30 rows, then decode one row a fire, committing (and sliding) after each; every row's logits."""
    kv = KVCache(cfg, 64, PAGE, torch.float32, layout=KVCache.layout_of(cfg, 0, swa_full))
    runner = ModelRunner(model, kv, torch.device("cpu"))
    pages = KVPages(PagePool(64), PAGE, runner.copy_pages, runner.copy_slots, kv.layout.windows)
    ws = WorkingSet(1, A, "m", tables=pages.empty_tables())
    out = []
    for start, rows in ((0, 30), *((i, 1) for i in range(30, len(ids)))):
        pages.reserve(ws, start, rows)
        seg = Segment(ws.pages, start, rows, group_tables=tuple(ws.tables[1:]))
        out.append(model.logits(runner.forward([seg], ids[start : start + rows], list(range(start, start + rows)))))
        ws.committed = start + rows
        pages.commit(ws)
    return torch.cat(out), pages, ws


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_the_window_pages_match_transformers(family):
    """The window itself (not only its pages): a random Mistral and a Gemma-3-shaped model (window 16) over 60
    rows, as transformers runs them, and bit for bit as the same model keeping every row."""
    from pie_runtime.models.config import config_from_hf
    from pie_runtime.models.families import build_causal_lm

    hf = hf_model(family)
    cfg = config_from_hf(hf.config.to_dict())
    assert isinstance(cfg, ModelConfig) and cfg.sliding_window == 16
    model = build_causal_lm(cfg).eval()
    model.load_state_dict(hf.state_dict())
    ids = [token(i) for i in range(60)]
    paged, pages, ws = run_window_pages(model, cfg, False, ids)
    full, _, _ = run_window_pages(model, cfg, True, ids)
    assert torch.equal(paged, full)
    windows = pages.windows
    assert windows == ((16,) if family == "mistral" else (None, 16, 16))
    for window, held in zip(windows, pages.held_per_group(ws)):
        assert held == (60 + PAGE - 1) // PAGE if window is None else held <= 16 // PAGE + 1
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(paged, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_the_native_step_reads_each_layers_page_group(family):
    """The native step (int8) through page groups: its logits bit for bit those of the same model keeping every
    row, over a prefill and decode past the window, and the sliding groups' pages bounded."""
    from pie_runtime.models import native_lib
    from pie_runtime.models.config import config_from_hf
    from pie_runtime.native_load import native_from_state

    if not native_lib.available():
        pytest.skip(f"no native kernels here ({native_lib.unavailable_reason()})")
    hf = hf_model(family, head_dim=64)  # the step's smallest head
    cfg = config_from_hf(hf.config.to_dict())
    assert isinstance(cfg, ModelConfig)
    native = native_from_state(cfg, hf.state_dict(), "int8")
    ids = [token(i) for i in range(60)]
    paged, pages, ws = run_window_pages(native, cfg, False, ids)
    full, _, _ = run_window_pages(native, cfg, True, ids)
    assert torch.equal(paged, full)
    for window, held in zip(pages.windows, pages.held_per_group(ws)):
        assert window is None or held <= 16 // PAGE + 1


@pytest.mark.parametrize("shape", ["mistral", "gemma"])
def test_the_prefix_cache_serves_only_one_global_group(shape):
    """The documented rule (working-sets.md): a sliding group's hit would need the prefix's last window of rows,
    which the cache does not name, so a sliding model's core has no prefix cache and a second working set with
    the same prompt runs it again; with every row kept (``--kv-swa-full``) the cache is on and the prompt hits."""
    prompt = [token(i) for i in range(40)]
    for swa_full in (False, True):
        c = Core(shape, swa_full)
        first, second = c.call("ws_open")["ws"], c.call("ws_open")["ws"]
        last = [{"rows": [len(prompt) - 1], "kind": "logits"}]  # rows read out must run: only the last is
        a, b = (decode_array(c.fire(ws, prompt, readouts=last)["results"][0]["logits"]) for ws in (first, second))
        assert np.allclose(a, b, atol=1e-5)
        cache = c.call("stats")["models"]["tiny"]["prefix_cache"]
        assert cache["enabled"] is swa_full
        assert (cache.get("hits", 0) > 0) is swa_full
