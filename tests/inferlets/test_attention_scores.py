"""The attention readout (``inferlet.AttentionScores``) on the real default model, in fp32 and bf16 (torch's path)
and int4 (the native step): each layer's mass is transformers' ``output_attentions`` summed over the heads (fp32
to 1e-4; bf16 and int4, whose activations are rounded or quantized, to 0.15 of the 9 heads' mass), with rows
evicted too (transformers then masks the evicted keys of the new row alone); a row's bits do not depend on the
batch it ran in; the summed readout is the per-layer one added in layer order; and readouts past the limits are
typed errors that change nothing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import inferlet
from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.reference import transformers_llama
from pie_runtime.shipped import ensure_default_model
from pie_runtime.store import DEFAULT_MODEL, ModelStore, load_model
from tests.conftest import in_session, pages_free, start_engine

PROMPT = "Once upon a time, there was a little girl named Emma who loved to play in the garden with her dog Max."
OTHER = "The quick brown fox jumps over the lazy dog, and then it ran 42 miles home to see its family again."
TOLERANCE = {"fp32": 1e-4, "bf16": 0.15, "int4": 0.15}  # per layer, of a mass of 9 (the query heads)


@dataclass(frozen=True)
class Served:
    address: str
    format: str  # the weight format the engine serves


@pytest.fixture(scope="module", params=["fp32", "bf16", "int4"])
def score_engine(request, pie_home):
    eng = start_engine(pie_home, [DEFAULT_MODEL], "--weights", request.param, "--pass-cost-rows", "0")
    yield Served(eng.address, request.param)
    eng.stop()


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """transformers' eager Llama over the fp32 weights the fp32 engine serves (the int4 engine's, dequantized)."""
    ensure_default_model()
    store = ModelStore()
    loaded = load_model(DEFAULT_MODEL, store=store)
    model = transformers_llama(store.path(DEFAULT_MODEL), loaded.model.config, tmp_path_factory.mktemp("hf"))
    model.set_attn_implementation("eager")
    return model


def hf_mass(hf_model, ids: list[int], row: int, hidden_from_last: tuple[int, ...] = ()) -> np.ndarray:
    """(layers, len(ids)) transformers' attention of query ``row`` summed over heads; keys ``hidden_from_last``
    are masked for the last query only (what an eviction before the last token does)."""
    n = len(ids)
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    allowed[-1, list(hidden_from_last)] = False
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        att = hf_model(torch.tensor([ids]), attention_mask=mask, output_attentions=True).attentions
    return torch.stack([a[0, :, row].sum(0) for a in att]).numpy()


def scores_of(res: inferlet.PassResult, i: int) -> np.ndarray:
    scores = res.readouts[i].scores
    assert scores is not None
    return scores


def test_mass_per_layer_matches_transformers(score_engine, hf_model):
    async def body(model):
        ids = model.tokenizer.encode(PROMPT)
        ws = model.working_set()
        fp = inferlet.ForwardPass(ws).embed(ids)
        fp.readout([0, 7, len(ids) - 1], inferlet.AttentionScores(per_layer=True))
        fp.readout([len(ids) - 1, 7], inferlet.AttentionScores())
        res = await fp.submit()
        await ws.release()
        return ids, scores_of(res, 0), scores_of(res, 1)

    ids, per_layer, summed = in_session(score_engine.address, body)
    layers = hf_model.config.num_hidden_layers
    assert per_layer.shape == (3, layers, len(ids)) and summed.shape == (2, len(ids))
    for i, row in enumerate([0, 7, len(ids) - 1]):
        want = hf_mass(hf_model, ids, row)
        np.testing.assert_allclose(per_layer[i], want, atol=TOLERANCE[score_engine.format], rtol=0)
        assert not per_layer[i][:, row + 1 :].any()  # later rows get exactly nothing
    # the summed readout is the per-layer one added in layer order, bit for bit
    in_order = np.cumsum(per_layer[[2, 1]], axis=1, dtype=np.float32)[:, -1]
    assert np.array_equal(summed, in_order)
    heads = hf_model.config.num_attention_heads
    np.testing.assert_allclose(per_layer.sum(-1), heads, rtol=1e-5)


def test_mass_after_eviction_is_over_the_kept_rows(score_engine, hf_model):
    """Rows dropped from the middle: the next token's mass covers the kept rows, indexed by row (not position),
    and equals transformers' with the dropped keys masked for that token alone."""
    evicted = [2, 3, 4, 5, 9, 14]

    async def body(model):
        ids = model.tokenizer.encode(PROMPT)
        ws = model.working_set()
        res = await inferlet.ForwardPass(ws).embed(ids).readout([len(ids) - 1], inferlet.Argmax()).submit()
        nxt = int(res.tokens[0])
        await ws.evict(rows=[9, 14], ranges=[(2, 6)])
        fp = inferlet.ForwardPass(ws).embed([nxt]).readout([0], inferlet.AttentionScores(per_layer=True))
        res = await fp.submit()
        position = ws.position
        await ws.release()
        return ids + [nxt], scores_of(res, 0)[0], position

    ids, got, position = in_session(score_engine.address, body)
    assert position == len(ids) and got.shape[1] == len(ids) - len(evicted)
    kept = [i for i in range(len(ids)) if i not in evicted]
    want = hf_mass(hf_model, ids, len(ids) - 1, tuple(evicted))[:, kept]
    np.testing.assert_allclose(got, want, atol=TOLERANCE[score_engine.format], rtol=0)


def test_a_rows_mass_does_not_depend_on_its_batch(score_engine):
    """The same decode row read alone and beside another sequence's prefill in one step: the same bits (in the
    formats whose passes are batch invariant: bf16 on torch's path, int4 on the native step)."""
    if score_engine.format == "fp32":
        pytest.skip("fp32 passes are not batch invariant (a matmul's kernel, so its rounding, moves with its rows)")

    async def body(model):
        ids = model.tokenizer.encode(PROMPT)
        # a prefill of several chunks (the engine's 256 rows a step): the decode row, sent while its first chunk
        # runs, joins one of the later chunks in a step (short fires first) however fast the machine
        other = model.tokenizer.encode(OTHER * 40)[:1000]

        async def decode_row(beside: list[int] | None) -> tuple[np.ndarray, int]:
            ws, ws2 = model.working_set(), model.working_set()
            await inferlet.ForwardPass(ws).embed(ids[:-1]).submit()
            fires = [] if beside is None else [await inferlet.ForwardPass(ws2).embed(beside).launch()]
            fp = inferlet.ForwardPass(ws).embed(ids[-1:]).readout([0], inferlet.AttentionScores(per_layer=True))
            res = await (await fp.launch())
            await asyncio.gather(*fires)
            rows = ws.step_rows
            await ws.release()
            await ws2.release()
            return scores_of(res, 0), rows

        alone, rows_alone = await decode_row(None)
        for _ in range(5):  # sent back to back they share a step; retried should the prefill have ended first
            batched, rows_batched = await decode_row(other)
            if rows_batched > 1:
                break
        return alone, rows_alone, batched, rows_batched

    alone, rows_alone, batched, rows_batched = in_session(score_engine.address, body)
    assert rows_alone == 1 and rows_batched > 1  # the second ran in one step beside the other prefill
    assert np.array_equal(alone, batched)


def test_readouts_past_the_limits_are_refused_and_change_nothing(score_engine):
    async def body(model):
        free = await pages_free(model)
        ws = model.working_set()
        codes = []
        for w, rows, kind in [
            (2100, range(1024), inferlet.AttentionScores()),  # 1024 x 2100 x 4 B > 8 MiB
            (1100, range(64), inferlet.AttentionScores(per_layer=True)),  # 64 x 30 x 1100 x 4 B
        ]:
            try:
                await inferlet.ForwardPass(ws).embed([1] * w).readout(rows, kind).submit()
            except PieError as e:
                codes.append(e.code)
        mask = np.full((1, (model.vocab_size + 31) // 32), -1, dtype=np.int32)
        try:
            await inferlet.ForwardPass(ws).embed([1, 2]).readout([1], inferlet.AttentionScores(), mask).submit()
        except PieError as e:
            codes.append(e.code)
        committed = ws.committed
        await ws.release()
        return codes, committed, free, await pages_free(model)

    codes, committed, before, after = in_session(score_engine.address, body)
    assert codes == [ErrorCode.LIMIT_EXCEEDED, ErrorCode.LIMIT_EXCEEDED, ErrorCode.INVALID_ARGUMENT]
    assert committed == 0 and after == before


def test_a_tree_rows_mass_covers_its_ancestors_only(score_engine):
    """A tree window's row attends the rows before the window and its ancestors: a sibling gets exactly 0."""

    async def body(model):
        ids = model.tokenizer.encode(PROMPT)
        ws = model.working_set()
        await inferlet.ForwardPass(ws).embed(ids).submit()
        fp = inferlet.ForwardPass(ws).embed([11, 22, 33, 44]).tree([-1, 0, 0, 2])
        res = await fp.readout([1, 3], inferlet.AttentionScores()).fold([0, 2, 3]).submit()
        await ws.release()
        return len(ids), scores_of(res, 0)

    n, scores = in_session(score_engine.address, body)
    assert scores.shape == (2, n + 4)
    row1, row3 = scores
    assert (row1[: n + 2] > 0).all() and not row1[n + 2 :].any()  # row 1: the prefix, its parent and itself
    assert (row3[:n] > 0).all() and row3[n] > 0 and row3[n + 1] == 0 and (row3[n + 2 :] > 0).all()
    np.testing.assert_allclose(scores.sum(-1), 9 * 30, rtol=1e-4)  # 9 query heads, 30 layers
