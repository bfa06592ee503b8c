"""A drafter's reduced vocabulary (models/draft_vocab.py) on a tiny random target: the slice is the most
frequent greedy tokens plus the ones always kept; sliced logits equal the target's on the slice and are -inf
elsewhere, for float and quantized lm heads; MTP and EAGLE heads draft only from their slice and carry it
through save and load exactly (ids stay integers), while files without one still load; a head served beside an
int4 target runs int8 layers that compute its quantized weights."""

from __future__ import annotations

import copy

import torch

from pie_runtime.models.draft_vocab import (
    DraftLogits,
    coverage,
    draft_logits,
    frequent_ids,
    served_head_weight,
    set_draft_vocab,
)
from pie_runtime.models.eagle import EagleConfig, EagleModule, load_eagle, save_eagle
from pie_runtime.models.llama import LlamaForCausalLM
from pie_runtime.models.mtp import MTPConfig, MTPHead, MTPModule, load_mtp, read_config, save_mtp
from pie_runtime.models.quant import Int8Linear, quantize_int8
from pie_runtime.models.weights import prepare_for_serving, serve_drafter
from tests.models.tiny_models import tiny_llama_config

CFG = tiny_llama_config()


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.15) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.8, 1.2)
    return module.requires_grad_(False).eval()


def target() -> LlamaForCausalLM:
    return randomized(LlamaForCausalLM(CFG), 0)  # pyright: ignore[reportReturnType]


def mtp_module(seed: int = 1) -> MTPModule:
    cfg = MTPConfig(
        hidden_size=64, intermediate_size=96, depth=3, vocab_size=300, target="tiny", target_digest="x" * 64
    )
    return randomized(MTPModule(cfg), seed)  # pyright: ignore[reportReturnType]


def test_frequent_ids_are_the_most_common_greedy_tokens_with_the_kept_ones():
    greedy = torch.tensor([5] * 9 + [7] * 5 + [3] * 5 + [11] * 2 + [2])
    assert frequent_ids(greedy, 20, 3).tolist() == [3, 5, 7]  # 3 and 7 tie: the lower id first
    assert frequent_ids(greedy, 20, 3, always=[19]).tolist() == [3, 5, 19]
    assert frequent_ids(torch.tensor([1, 1, 2]), 4, 10).tolist() == [0, 1, 2, 3]  # capped at the vocabulary
    assert abs(coverage(torch.tensor([5, 7]), greedy) - 14 / 22) < 1e-6


def test_sliced_logits_equal_the_targets_on_the_slice_and_nothing_elsewhere():
    t = target()
    ids = torch.tensor([0, 4, 17, 150, 299])
    h = torch.randn(6, 64)
    full = t.logits(h)
    sliced = DraftLogits(t.logits, t.lm_head, ids, 64, 300)(h)
    assert sliced.shape == full.shape and sliced.dtype == torch.float32
    torch.testing.assert_close(sliced[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)
    outside = torch.ones(300, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(sliced[:, outside]).all()
    assert torch.isin(sliced.argmax(-1), ids).all()
    whole = DraftLogits(t.logits, t.lm_head, None, 64, 300)(h)
    assert torch.equal(whole, full)
    batched = DraftLogits(t.logits, t.lm_head, ids, 64, 300)(h.view(2, 3, 64))  # (B, T, H) as training passes it
    assert torch.equal(batched.view(6, 300), sliced)


def test_the_slice_of_a_quantized_head_is_the_weight_it_serves():
    w = torch.randn(300, 64)
    head = Int8Linear(quantize_int8(w))
    got = served_head_weight(head, 64, torch.bfloat16, "cpu")
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert got.shape == (300, 64) and got.dtype == torch.bfloat16
    torch.testing.assert_close((x @ got.T).float(), head(x).float(), rtol=2e-2, atol=6e-2)  # bf16 rounding
    assert (got.float() - w).abs().max() < 0.05  # close to the float weight it was quantized from


def test_a_sliced_mtp_head_drafts_only_from_its_slice_and_round_trips(tmp_path):
    t = target()
    module = mtp_module()
    ids = torch.arange(0, 300, 7)
    set_draft_vocab(module, ids)
    assert module.config.draft_vocab == ids.numel()
    h, first = torch.randn(8, 64), torch.randint(0, 300, (8,))
    tokens, logits = MTPHead(module, t).draft(h, first, 3)
    assert torch.isin(tokens, ids).all() and all(lg.shape == (8, 300) for lg in logits)
    save_mtp(module, tmp_path / "head.safetensors", dtype=torch.bfloat16)
    back = load_mtp(tmp_path / "head.safetensors")
    assert back.draft_ids.dtype == torch.int64 and torch.equal(back.draft_ids, ids)
    assert read_config(tmp_path / "head.safetensors").draft_vocab == ids.numel()
    again, _ = MTPHead(back, t).draft(h, first, 3)
    assert torch.isin(again, ids).all()


def test_a_head_without_a_slice_still_loads_and_drafts_over_the_whole_vocabulary(tmp_path):
    t = target()
    module = mtp_module()
    save_mtp(module, tmp_path / "old.safetensors")
    back = load_mtp(tmp_path / "old.safetensors")
    assert back.config.draft_vocab == 0 and not hasattr(back, "draft_ids")
    assert draft_logits(back, t).ids is None
    h, first = torch.randn(4, 64), torch.randint(0, 300, (4,))
    tokens, logits = MTPHead(back, t).draft(h, first, 2)
    torch.testing.assert_close(logits[0], t.logits(MTPHead(back, t).step(h, first)))
    set_draft_vocab(module, torch.tensor([1, 2]))
    set_draft_vocab(module, None)  # taking a slice away again
    assert module.config.draft_vocab == 0 and "draft_ids" not in module.state_dict()


def test_an_eagle_head_carries_its_slice_through_save_and_load(tmp_path):
    module = randomized(EagleModule(EagleConfig.for_target(CFG, 3, "tiny", "x" * 64)), 2)
    ids = torch.tensor([1, 2, 3, 250])
    set_draft_vocab(module, ids)
    save_eagle(module, tmp_path / "eagle.safetensors")  # pyright: ignore[reportArgumentType]
    back = load_eagle(tmp_path / "eagle.safetensors", torch.bfloat16)
    assert back.config.draft_vocab == 4 and torch.equal(back.draft_ids, ids)
    assert back.fc.weight.dtype == torch.bfloat16


def test_a_head_served_beside_an_int4_target_runs_int8_layers_that_compute_its_quantized_weights():
    t = prepare_for_serving(target(), "int4")  # int4 projections, an int8 lm head, bf16 activations
    module = mtp_module()
    set_draft_vocab(module, torch.arange(0, 300, 3))
    ref = copy.deepcopy(module)  # what int8 should compute: each weight, loaded in bf16, as it dequantizes
    for m in ref.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.copy_(quantize_int8(m.weight.to(torch.bfloat16)).dequantize(torch.float32))
    ref = MTPHead(ref.to(torch.bfloat16), t)
    served = MTPHead(serve_drafter(module.to(torch.bfloat16), "int4"), t)
    assert not any(isinstance(m, torch.nn.Linear) for m in served.module.modules())
    assert any(isinstance(m, Int8Linear) for m in served.module.modules())
    assert isinstance(served.logits.rows, Int8Linear)  # the slice of the int8 head stays int8
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    sliced = served.logits.ids
    assert sliced is not None and torch.equal(served.logits(x)[:, sliced], t.logits(x)[:, sliced])  # its own rows
    h, first = torch.randn(16, 64, dtype=torch.bfloat16), torch.randint(0, 300, (16,))
    want, got = ref.step(h, first).float(), served.step(h, first).float()
    assert (got - want).norm() / want.norm() < 0.02  # bf16 rounding of the activations and sums
    lw, lg = ref.logits(ref.step(h, first)), served.logits(served.step(h, first))
    ids = served.logits.ids
    assert ids is not None and torch.isneginf(lg[:, torch.isin(torch.arange(300), ids, invert=True)]).all()
    assert (lg[:, ids] - lw[:, ids]).norm() / lw[:, ids].norm() < 0.03
    for fmt in ("fp32", "bf16"):  # formats with float projections keep the module as loaded
        kept = mtp_module()
        assert serve_drafter(kept, fmt) is kept and isinstance(kept.proj, torch.nn.Linear)


def test_a_greedy_chain_without_logits_drafts_the_same_tokens():
    """``with_logits=False`` argmaxes the slice's own logits instead of the (V,)-wide ones: the same tokens for
    a float slice, the served int8 slice and the whole vocabulary, ties going to the lower id either way."""
    t = target()
    served_t = prepare_for_serving(target(), "int4")
    h, first = torch.randn(16, 64), torch.randint(0, 300, (16,))
    for tgt, dtype in ((t, torch.float32), (served_t, torch.bfloat16)):
        for ids in (torch.arange(0, 300, 7), None):
            module = mtp_module()
            if ids is not None:
                set_draft_vocab(module, ids)
            module = serve_drafter(module.to(dtype), "int4" if dtype == torch.bfloat16 else "fp32")
            head = MTPHead(module, tgt)
            tokens, logits = head.draft(h.to(dtype), first, 3)
            fast, none = head.draft(h.to(dtype), first, 3, with_logits=False)
            assert torch.equal(fast, tokens) and none == [] and len(logits) == 3
    ids = torch.tensor([3, 9, 40])
    tied = DraftLogits(None, torch.nn.Linear(4, 300, bias=False), ids, 4, 300)
    tied.weight = torch.ones(3, 4)  # every row of the slice scores the same
    x = torch.randn(2, 4)
    assert tied.greedy(x).tolist() == tied(x).argmax(-1).tolist() == [3, 3]
