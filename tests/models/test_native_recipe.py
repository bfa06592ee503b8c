"""The native step's per-layer recipe (models/native_model.py, kernels/native/step.c): Gemma 3 (sandwich norms of
1 + w, tanh-GELU, q/k norms, query_pre_attn_scalar, a rope table per layer kind, sliding layers), Mistral's window
and Qwen3's q/k norms against transformers on the same (Q8_0-rounded) weights, through chunked prefill and a verify
window; sliding layers read only their window's rows (the others poisoned); a row's bits do not depend on its
batch, its chunking or its tree under a window; the ctypes structs agree with the library's."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch

from pie_runtime.models import native_abi, native_lib
from pie_runtime.models.attention_scores import PassScores, ScoreRow
from pie_runtime.models.config import ModelConfig
from pie_runtime.models.context import ForwardContext, Segment
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.native_linear import quantize_q8_0
from pie_runtime.models.native_model import NativeLlama
from pie_runtime.native_load import native_from_state

pytestmark = pytest.mark.skipif(
    not native_lib.available(), reason=f"no native kernels here ({native_lib.unavailable_reason()})"
)
PAGE = 16
VOCAB = 300
SLIDING, FULL = "sliding_attention", "full_attention"


def hf_model(family: str, window: int | None = 8, layers: int = 4, seed: int = 0):
    """A random transformers model of ``family`` (head_dim 64, the step's smallest), its weights rounded to Q8_0
    so that the native int8 format holds them exactly, its norms away from their init."""
    import transformers

    torch.manual_seed(seed)
    shape: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
    )
    if family == "gemma3":
        kinds = [SLIDING if (i + 1) % 3 else FULL for i in range(layers)]  # a global layer among sliding ones
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
        rope["sliding_attention"] = {"rope_type": "default", "rope_theta": 1e4}
        config = transformers.Gemma3TextConfig(
            **shape, query_pre_attn_scalar=48, sliding_window=window or 4096, layer_types=kinds, rope_parameters=rope
        )
        model = transformers.Gemma3ForCausalLM(config)
    elif family == "mistral":
        config = transformers.MistralConfig(**shape, sliding_window=window)
        model = transformers.MistralForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**shape)
        model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's w (the model multiplies by 1 + w) near 0, the others' near 1
                p.normal_(0, 0.1) if family == "gemma3" else p.uniform_(0.8, 1.2)
            elif p.dim() == 2:
                q, d = quantize_q8_0(p)
                p.copy_((q.float().view(p.shape[0], -1, 32) * d.float().unsqueeze(-1)).view(p.shape))
    return model.eval(), ModelConfig.from_hf(config.to_dict())


def run(model: NativeLlama, segments: list[Segment], ids: list[int], kv: KVCache, positions=None, scores=None):
    ctx = ForwardContext.build(segments, PAGE, positions=positions, torch_groups=False, scores=scores)
    return model.logits(model.forward(model.embed(torch.tensor(ids)), ctx, kv))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_the_struct_copies_agree_with_the_library_and_a_drift_is_named():
    lib = native_lib.library()
    assert lib is not None
    native_abi.check_layouts(lib)  # raises on any difference
    c = native_abi.c_layout(lib)
    assert c["PieLayer"] == ctypes.sizeof(native_abi.PieLayer) and "PiePass.layouts" in c

    class PieLayer(ctypes.Structure):  # a hand copy that lost a field
        _fields_ = [f for f in native_abi.PieLayer._fields_ if f[0] != "ff_post_norm"]

    lines = native_abi.compare(c, native_abi.py_layout((PieLayer, *native_abi.STRUCTS[2:], native_abi.PassLayout)))
    assert any(line.startswith("PieLayer.ff_post_norm") for line in lines)
    assert any(line.startswith("PieLayer:") for line in lines)  # its size too


@pytest.mark.parametrize("family", ["gemma3", "mistral", "qwen3"])
def test_the_native_step_computes_transformers_model(family):
    """Logits over 48 tokens (past the window of 8): a prompt in chunks of 13, 1, 17 and 9 rows, then a verify
    window of 8 rows, against transformers' over the whole sequence: close (the step's 8-bit activations), and
    far from the same model without its window."""
    hf, cfg = hf_model(family)
    native = native_from_state(cfg, hf.state_dict(), "int8")
    ids, table = prompt(48, 1), list(range(4))
    kv, at, got = KVCache(cfg, 4, PAGE, torch.float32), 0, []
    for n in (13, 1, 17, 9, 8):
        got.append(run(native, [Segment(table, at, n)], ids[at : at + n], kv))
        at += n
    got = torch.cat(got)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert rel(got, want) < 0.03
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
    if family != "qwen3":
        unwindowed, _ = hf_model(family, window=4096)
        unwindowed.load_state_dict(hf.state_dict())
        with torch.no_grad():
            assert rel(got[8:], unwindowed(torch.tensor([ids])).logits[0, 8:]) > 0.3


def poisoned(kv: KVCache, layers: list[int], slots: list[int]) -> KVCache:
    out = KVCache.__new__(KVCache)
    out.num_pages, out.page_size, out.layout = kv.num_pages, kv.page_size, kv.layout
    out.k, out.v = kv.k.clone(), kv.v.clone()
    for layer in layers:
        out.k[layer][:, slots] = float("nan")
        out.v[layer][:, slots] = float("nan")
    return out


def test_sliding_layers_read_only_their_window():
    """K/V rows outside a sliding layer's window set to NaN leave a decode row's and a verify window's logits
    bit for bit as they were (a row read and weighted 0 would still carry the NaN); in a global layer they do
    not. The attention readout gives a sliding layer's keys outside the window exactly 0."""
    hf, cfg = hf_model("gemma3", window=20, layers=3, seed=3)
    native = native_from_state(cfg, hf.state_dict(), "int8")
    sliding = [i for i in range(3) if cfg.attention_window(i) is not None]
    ids, table = prompt(60, 4), [6, 2, 7, 0, 5]  # pages out of order
    kv = KVCache(cfg, 8, PAGE, torch.bfloat16)
    run(native, [Segment(table, 0, 50)], ids[:50], kv)
    slot = [table[j // PAGE] * PAGE + j % PAGE for j in range(50)]
    decode = run(native, [Segment(table, 50, 1)], [ids[50]], kv)
    # row 50 keeps keys 31..50: rows 0..30 are out of every sliding layer's window, row 31 in it
    assert torch.equal(run(native, [Segment(table, 50, 1)], [ids[50]], poisoned(kv, sliding, slot[:31])), decode)
    assert run(native, [Segment(table, 50, 1)], [ids[50]], poisoned(kv, sliding, slot[31:32])).isnan().all()
    assert run(native, [Segment(table, 50, 1)], [ids[50]], poisoned(kv, [2], slot[:1])).isnan().all()
    window = run(native, [Segment(table, 50, 6)], ids[50:56], kv)  # its first row keeps keys 31..50 too
    assert torch.equal(run(native, [Segment(table, 50, 6)], ids[50:56], poisoned(kv, sliding, slot[:31])), window)
    assert torch.equal(window[0], decode[0])
    scores = PassScores([ScoreRow(0, 51, True)], [Segment(table, 50, 1)], PAGE, 3, "cpu")
    run(native, [Segment(table, 50, 1)], [ids[50]], kv, scores=scores)
    mass = scores.out[0]  # (layers, 51): each layer's two heads' probabilities, summed
    for layer in range(3):
        kept = 31 if layer in sliding else 0
        assert torch.all(mass[layer, :kept] == 0) and torch.all(mass[layer, kept:] > 0)
        assert mass[layer].sum().item() == pytest.approx(2.0, abs=1e-4)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_windowed_row_gets_its_bits_beside_others_however_chunked_and_in_a_tree(fmt):
    """A window of 300 keys (two parts of 256 past its start): the existing guarantees, with sliding layers."""
    hf, cfg = hf_model("gemma3", window=300, layers=3, seed=5)
    native = native_from_state(cfg, hf.state_dict(), fmt)
    kv = KVCache(cfg, 64, PAGE, torch.bfloat16)
    a, b = prompt(600, 6), prompt(560, 7)
    ta = [5, 3, 9, 11, 2, 30, 31, 40, 41, 0, 1, 60, 61, 62, 63, 20, 21, 22, 23, 50, 51, 52, 53, 54, 55, 56, 57, 58]
    tb = [p for p in range(64) if p not in ta][:36]
    run(native, [Segment(ta, 0, 420)], a[:420], kv)
    run(native, [Segment(tb, 0, 513)], b[:513], kv)
    singles = torch.cat([run(native, [Segment(ta, 420 + i, 1)], [a[420 + i]], kv) for i in range(8)])
    assert torch.equal(run(native, [Segment(ta, 420, 8)], a[420:428], kv), singles)
    beside = run(native, [Segment(tb, 513, 5), Segment(ta, 420, 3)], b[513:518] + a[420:423], kv)
    assert torch.equal(beside[5:], singles[:3])
    whole = run(native, [Segment(ta, 0, 428)], a[:428], KVCache(cfg, 64, PAGE, torch.bfloat16))
    kv2, at, parts = KVCache(cfg, 64, PAGE, torch.bfloat16), 0, []
    for n in (100, 237, 1, 1, 61, 28):
        parts.append(run(native, [Segment(ta, at, n)], a[at : at + n], kv2))
        at += n
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(whole[420:], singles)
    # a tree window after 420 rows: rows 0 root, 1 and 2 children of 0, 3 child of 2, 4 child of 1
    parents, tokens = (-1, 0, 0, 2, 1), [a[420], 7, a[421], a[422], 9]
    tree = run(native, [Segment(ta, 420, 5, parents=parents, window=420)], tokens, kv2, [420, 421, 421, 422, 422])
    assert torch.equal(tree[[0, 2, 3]], singles[:3])  # the path 0 → 2 → 3 run as a chain
