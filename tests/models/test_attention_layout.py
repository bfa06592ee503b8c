"""How a pass lays its rows out for attention (models/context.py): a group whose queries are the batch's rows
in order is sliced instead of gathered and scattered, and the mask each attention form derives is computed
once a pass and shared by the layers. Both are layout only: a row's bits equal the general path's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pie_runtime.models import llama
from pie_runtime.models.context import ForwardContext, Segment
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.weights import ACTIVATION_DTYPE
from tests.models.test_weights import PAGE, prepared
from tests.models.tiny_models import TINY_VOCAB

A, B, C = [0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]  # 24 keys each
# (segments as (pages, start, rows), the groups' row spans): prompts first, then the layouts a step runs
PROMPTS = [(A, 0, 17), (B, 0, 9), (C, 0, 12)]
LAYOUTS = [
    ([(A, 17, 1)], [(0, 1)]),  # a decode step
    ([(A, 17, 1), (B, 9, 1), (C, 12, 1)], [(0, 3)]),  # a batch
    ([(A, 17, 3), (B, 9, 3)], [(0, 6)]),  # verify windows of one length
    ([(A, 17, 3), (B, 9, 1)], [None]),  # of two lengths: padded, gathered
    ([(B, 9, 2), (A, 17, 1)], [None]),
    ([(A, 17, 1), (C, 12, 9)], [(0, 1), (1, 9)]),  # a decode row, a chunk
]


def test_a_group_has_a_row_span_only_when_its_queries_are_the_rows_in_order():
    for segments, spans in LAYOUTS:
        ctx = ForwardContext.build([Segment(*s) for s in segments], PAGE)
        assert [g.row_span for g in ctx.groups] == spans, segments


@pytest.mark.parametrize("fp32_attention", [True, False], ids=["fp32-form", "bf16-form"])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_the_sliced_rows_and_the_shared_mask_give_the_gathered_paths_bits(fmt, fp32_attention, tiny_store, monkeypatch):
    monkeypatch.setattr(llama, "FP32_ATTENTION", fp32_attention)
    store, _ = tiny_store
    model = prepared("tiny-llama", fmt, store)
    kv = KVCache(model.config, 18, PAGE, ACTIVATION_DTYPE[fmt])
    gen = torch.Generator().manual_seed(3)

    def run(ctx: ForwardContext, ids: list[int]) -> torch.Tensor:
        return model.logits(model.forward(model.embed(torch.tensor(ids)), ctx, kv))

    for pages, start, rows in PROMPTS:
        run(
            ForwardContext.build([Segment(pages, start, rows)], PAGE),
            torch.randint(0, TINY_VOCAB, (rows,), generator=gen).tolist(),
        )
    for segments, _ in LAYOUTS:
        ctx = ForwardContext.build([Segment(*s) for s in segments], PAGE)
        ids = torch.randint(0, TINY_VOCAB, (sum(s[2] for s in segments),), generator=gen).tolist()
        fast = run(ctx, ids)  # writes the same K/V a second run writes again
        assert all(len(g.memo) == 1 for g in ctx.groups)  # one mask a group, whatever the number of layers
        gathered = dataclasses.replace(ctx, groups=tuple(dataclasses.replace(g, row_span=None) for g in ctx.groups))
        assert torch.equal(fast, run(gathered, ids)), segments


@pytest.mark.parametrize("page_size", [24, 128], ids=["24", "128"])
def test_the_float32_form_gives_a_row_the_same_bits_whatever_the_page_size(page_size, tiny_store, monkeypatch):
    """Pages are gathered straight into blocks of FP32_KEYS keys: a page size that does not divide the block
    overshoots and is cut, one larger than the block pads by whole pages. Only masked keys differ, so a prompt and
    its decode rows get the bits they get with 4-token pages."""
    monkeypatch.setattr(llama, "FP32_ATTENTION", True)
    store, _ = tiny_store
    model = prepared("tiny-llama", "int4", store)
    ids = torch.randint(0, TINY_VOCAB, (90,), generator=torch.Generator().manual_seed(5)).tolist()

    def rows(ps: int) -> list[torch.Tensor]:
        kv = KVCache(model.config, -(-256 // ps) + 1, ps, ACTIVATION_DTYPE["int4"])
        pages = list(range(1, -(-90 // ps) + 1))  # page 0 is the padding's, as in the pool
        out = []
        for start, n in [(0, 70), (70, 1), (71, 4), (75, 15)]:
            ctx = ForwardContext.build([Segment(pages, start, n)], ps)
            out.append(model.logits(model.forward(model.embed(torch.tensor(ids[start : start + n])), ctx, kv)))
        return out

    for a, b in zip(rows(PAGE), rows(page_size), strict=True):
        assert torch.equal(a, b)
