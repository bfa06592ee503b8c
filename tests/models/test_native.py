"""The native step (models/native_lib.py, native_linear.py, native_model.py, kernels/native/): which ISA variant
runs where, the integer-dot matmuls against the float matmul of the same weights, and the guarantee that makes
speculation exact: a row's bits do not depend on the rows beside it (matmul rows 1..17, a verify window against
single-row passes, a batch of sequences, a prompt's chunking, a tree window against its path, every variant).
The default model's agreement with fp32 in the native formats is in test_weights.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pie_runtime.models import native_lib
from pie_runtime.models.config import ModelConfig
from pie_runtime.models.context import ForwardContext, Segment
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.llama import LlamaForCausalLM
from pie_runtime.models.native_linear import PackedLinear, PackedWeight, quantize_q8_0
from pie_runtime.models.native_model import NativeLlama, unsupported
from pie_runtime.models.quant import quantize_int4
from pie_runtime.native_load import native_from_state

pytestmark = pytest.mark.skipif(
    not native_lib.available(), reason=f"no native kernels here ({native_lib.unavailable_reason()})"
)
PAGE = 16
VOCAB = 300


def test_the_best_variant_the_cpu_has_is_chosen():
    base = {"avx2", "fma", "f16c"}
    vnni512 = base | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert native_lib.choose_variant(vnni512).name == "avx512vnni"  # type: ignore[union-attr]
    amx = vnni512 | {"amx_tile", "amx_int8"}
    assert native_lib.choose_variant(amx).name == "amx"  # type: ignore[union-attr]
    assert native_lib.choose_variant(amx, "avx512vnni").name == "avx512vnni"  # type: ignore[union-attr]
    assert native_lib.choose_variant(base | {"avx_vnni"}).name == "avxvnni"  # type: ignore[union-attr]
    assert native_lib.choose_variant(base).name == "avx2"  # type: ignore[union-attr]
    assert native_lib.choose_variant(vnni512, "avx2").name == "avx2"  # type: ignore[union-attr]
    assert "lacks f16c" in native_lib.choose_variant({"avx2", "fma"})  # type: ignore[operator]
    assert "cannot run" in native_lib.choose_variant(base, "avx512vnni")  # type: ignore[operator]
    assert "none of" in native_lib.choose_variant(base, "sse2")  # type: ignore[operator]


def weights(n: int, k: int, bits: int, seed: int) -> tuple[PackedWeight, torch.Tensor]:
    """A random (n, k) weight packed in ``bits``, and the float weight the packed one stands for."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if bits == 4:
        gq = quantize_int4(w)
        gq.d, gq.m = gq.d.half().float(), gq.m.half().float()  # what the packed form keeps
        return PackedWeight.from_group_quant(gq), gq.dequantize()
    q, d = quantize_q8_0(w)
    return PackedWeight.pack_q8(q, d), (q.float().view(n, -1, 32) * d.float().unsqueeze(-1)).view(n, k)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_integer_dot_matmul_computes_the_float_one(bits):
    """What is left is the 8-bit rounding of the activations (per block of 32, as llama.cpp's Q8_1)."""
    packed, w = weights(203, 576, bits, seed=bits)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(1))
    want = x @ w.T
    got = packed.matmul(x)
    assert got.shape == (9, 203) and got.dtype == torch.float32
    assert ((got - want).norm() / want.norm()).item() < 0.01


@pytest.mark.parametrize("bits", [4, 8])
def test_a_matmul_row_gets_the_same_bits_in_any_call(bits):
    packed, _ = weights(203, 1536, bits, seed=10 + bits)  # n not a multiple of 8: a partial group
    x = torch.randn(17, 1536, generator=torch.Generator().manual_seed(2))
    full = packed.matmul(x)
    for m in range(1, 18):
        assert torch.equal(packed.matmul(x[:m]), full[:m]), m
        assert torch.equal(packed.matmul(x[m - 1 : m]), full[m - 1 : m]), m
    shuffled = torch.randperm(17, generator=torch.Generator().manual_seed(3))
    assert torch.equal(packed.matmul(x[shuffled]), full[shuffled])


def test_rows_and_slices_of_a_packed_weight():
    """Rows come back dequantized (an embedding table shared with a tied head), and a slice of rows computes
    the head's outputs for them bit for bit (a drafter's reduced vocabulary)."""
    packed, w = weights(203, 576, 8, seed=4)
    ids = torch.tensor([0, 7, 8, 9, 150, 202])
    assert torch.equal(packed.rows(ids), w[ids])
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(5))
    head = PackedLinear(packed)
    assert torch.equal(head.rows(ids)(x), head(x)[:, ids])
    packed4, w4 = weights(40, 64, 4, seed=6)
    assert torch.equal(packed4.rows(torch.arange(40)), w4)


def test_a_compiled_graph_holds_the_native_matmul_as_one_op():
    """``pie::native_qmatmul``: no graph break around the ctypes call, and the compiled graph's result is the
    eager one bit for bit."""
    packed, _ = weights(40, 64, 4, seed=7)
    layer = PackedLinear(packed, bias=torch.randn(40))

    def f(x: torch.Tensor) -> torch.Tensor:
        return layer(torch.nn.functional.silu(x)) * 2

    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch._dynamo.explain(f)(x).graph_break_count == 0
        assert torch.equal(torch.compile(f)(x), f(x))


def test_every_variant_the_cpu_runs_gives_4_bit_rows_the_same_bits(tmp_path):
    """A 4-bit block's integer sum is exact on every variant (AVX2's maddubs cannot saturate on values of 0..15)
    and each variant scales it in the same float order, so the CPU's variants agree bit for bit (8-bit weights
    differ on AVX2, which moves their sign onto x)."""
    runs = [run_variant_if_runs(v.name, tmp_path / f"{v.name}.pt") for v in native_lib.VARIANTS]
    got = [r["q4"] for r in runs if r is not None]
    assert len(got) >= 2  # avx2 runs wherever any variant does
    for other in got[1:]:
        assert torch.equal(got[0], other)


def tiny_config(**switches) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        **switches,
    )


def random_pair(fmt: str, seed: int = 0, **switches) -> tuple[NativeLlama, LlamaForCausalLM]:
    """A random model on the native step and the float model it was made from."""
    torch.manual_seed(seed)
    cfg = tiny_config(**switches)
    ref = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():  # norms near 1, like a trained model's
            if "norm" in name:
                p.uniform_(0.8, 1.2)
    return native_from_state(cfg, ref.state_dict(), fmt), ref


def logits_of(model, segments: list[Segment], ids: list[int], kv: KVCache, positions=None) -> torch.Tensor:
    native = isinstance(model, NativeLlama)
    ctx = ForwardContext.build(segments, PAGE, positions=positions, torch_groups=not native)
    return model.logits(model.forward(model.embed(torch.tensor(ids)), ctx, kv))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "switches", [{}, {"attention_bias": True}, {"qk_norm": True}, {"tie_word_embeddings": True}], ids=str
)
def test_the_native_model_computes_the_float_model(switches):
    """int8 (Q8_0 weights, 8-bit activations) against the float model it was made from: close, same argmax."""
    native, ref = random_pair("int8", **switches)
    ids, table = prompt(70, 1), list(range(8))
    got = logits_of(native, [Segment(table, 0, 70)], ids, KVCache(native.config, 8, PAGE, torch.bfloat16))
    want = logits_of(ref, [Segment(table, 0, 70)], ids, KVCache(ref.config, 8, PAGE, torch.float32))
    assert ((got - want).norm() / want.norm()).item() < 0.03
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_row_gets_its_bits_in_a_window_beside_others_and_however_chunked(fmt):
    native, _ = random_pair(fmt, seed=2)
    kv = KVCache(native.config, 64, PAGE, torch.bfloat16)
    a, b = prompt(300, 3), prompt(520, 4)
    ta = [5, 3, 9, 11, 2, 30, 31, 40, 41, 0, 1, 60, 61, 62, 63, 20, 21, 22, 23]  # out of order, as a pool hands them
    tb = [p for p in range(64) if p not in ta][:34]
    logits_of(native, [Segment(ta, 0, 290)], a[:290], kv)  # a's context: more than one part of 256 keys
    logits_of(native, [Segment(tb, 0, 513)], b[:513], kv)  # b's, longer
    singles = torch.cat([logits_of(native, [Segment(ta, 290 + i, 1)], [a[290 + i]], kv) for i in range(8)])
    window = logits_of(native, [Segment(ta, 290, 8)], a[290:298], kv)
    assert torch.equal(window, singles)
    beside = logits_of(native, [Segment(tb, 513, 5), Segment(ta, 290, 3)], b[513:518] + a[290:293], kv)
    assert torch.equal(beside[5:], singles[:3])
    # the same prompt in one chunk, in other chunks, and after a cached prefix
    whole = logits_of(native, [Segment(ta, 0, 298)], a[:298], KVCache(native.config, 64, PAGE, torch.bfloat16))
    kv2, at = KVCache(native.config, 64, PAGE, torch.bfloat16), 0
    parts = []
    for n in (100, 37, 1, 1, 61, 98):
        parts.append(logits_of(native, [Segment(ta, at, n)], a[at : at + n], kv2))
        at += n
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(whole[290:], singles)


def test_a_tree_row_gets_the_bits_of_its_path_run_as_a_chain():
    """A tree window's row sees the rows before the window and its ancestors; after its path is folded into
    consecutive rows, the same row in a chain gets the same bits (the keys are the same, in the same order)."""
    native, _ = random_pair("int4", seed=5)
    ids, table = prompt(120, 6), list(range(16))
    kv = KVCache(native.config, 16, PAGE, torch.bfloat16)
    logits_of(native, [Segment(table, 0, 100)], ids[:100], kv)
    # window rows: 0 root, 1 and 2 children of 0, 3 child of 2, 4 child of 1
    parents, tokens = (-1, 0, 0, 2, 1), [ids[100], 7, ids[101], ids[102], 9]
    ctx_pos = [100, 101, 101, 102, 102]  # committed + depth
    tree = ForwardContext.build(
        [Segment(table, 100, 5, parents=parents, window=100)], PAGE, positions=ctx_pos, torch_groups=False
    )
    tree_logits = native.logits(native.forward(native.embed(torch.tensor(tokens)), tree, kv))
    kv_chain = KVCache(native.config, 16, PAGE, torch.bfloat16)
    logits_of(native, [Segment(table, 0, 100)], ids[:100], kv_chain)
    chain = logits_of(native, [Segment(table, 100, 3)], ids[100:103], kv_chain)  # the path 0 → 2 → 3
    assert torch.equal(tree_logits[[0, 2, 3]], chain)


def test_rope_takes_the_positions_given_not_the_row_index():
    """Rows keep the positions they were written at (an edited working set): attention reads the page table
    in order, rope the explicit positions. Shifting every position alike leaves a prompt's logits close
    (rope depends on relative positions only), but not equal (the rotations' rounding moves)."""
    native, _ = random_pair("int8", seed=7)
    ids, table = prompt(40, 8), list(range(4))
    plain = logits_of(native, [Segment(table, 0, 40)], ids, KVCache(native.config, 4, PAGE, torch.bfloat16))
    same = logits_of(
        native, [Segment(table, 0, 40)], ids, KVCache(native.config, 4, PAGE, torch.bfloat16), list(range(40))
    )
    assert torch.equal(plain, same)
    shifted = logits_of(
        native, [Segment(table, 0, 40)], ids, KVCache(native.config, 4, PAGE, torch.bfloat16), list(range(500, 540))
    )
    assert not torch.equal(shifted, plain)
    assert ((shifted - plain).norm() / plain.norm()).item() < 0.02


def test_what_the_native_step_does_not_run_is_said():
    assert unsupported(tiny_config()) is None
    cfg = tiny_config().model_copy(update={"head_dim": 16})
    assert "head_dim 16" in (unsupported(cfg) or "")


CHECK_VARIANT = textwrap.dedent(
    """
    import torch
    from pie_runtime.models import native_lib
    from pie_runtime.models.native_linear import PackedWeight, quantize_q8_0
    from pie_runtime.models.quant import quantize_int4
    assert native_lib.variant() == "{variant}", native_lib.variant()
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(203, 576, generator=g), torch.randn(40, 576, generator=g)
    from tests.models.quant_blocks import random_blocks
    parts = [random_blocks("q4_k", 64, 768, 1), random_blocks("q6_k", 64, 768, 2), random_blocks("q5_1", 75, 768, 3)]
    wx, wx_ref = PackedWeight.pack_blocks(parts), torch.cat([p.dequantize() for p in parts])
    import dataclasses
    from pie_runtime.models.native_linear import _pack_parts, _part_rows
    q6 = _part_rows(parts[1], 0, 64)  # Q6_K in 6 bits (s6) and as bytes (s16): the same bits at any row count
    q6x = torch.randn(40, 768, generator=torch.Generator().manual_seed(2))
    q6_six, q6_bytes = _pack_parts([q6], 64, 768), _pack_parts([dataclasses.replace(q6, sub="s16")], 64, 768)
    for m in (*range(1, 18), 40):
        assert torch.equal(q6_six.matmul(q6x[:m]), q6_bytes.matmul(q6x[:m])), ("q6_k", m)
    results = {{}}
    for name, packed, ref in (("q4", PackedWeight.from_group_quant(quantize_int4(w)), quantize_int4(w).dequantize()),
                              ("q8", PackedWeight.pack_q8(*quantize_q8_0(w)), None), ("wx", wx, wx_ref)):
        x = torch.randn(40, packed.k, generator=torch.Generator().manual_seed(1))
        full = results[name] = packed.matmul(x)
        for m in (*range(1, 18), 31, 40):
            assert torch.equal(packed.matmul(x[:m]), full[:m]), m
            assert torch.equal(packed.matmul(x[m - 1 : m]), full[m - 1 : m]), m
        if ref is not None:
            assert ((full - x @ ref.T).norm() / (x @ ref.T).norm()).item() < 0.01
    torch.save(results, "{out}")
    print(native_lib.variant(), "ok")
    """
)


def run_variant_if_runs(variant: str, out: Path) -> dict[str, torch.Tensor] | None:
    """The CHECK_VARIANT script's matmuls in a process of its own running ``variant``; None where the CPU cannot
    run it."""
    if isinstance(native_lib.choose_variant(native_lib.cpu_flags(), variant), str):
        return None
    return run_variant(variant, out)


def run_variant(variant: str, out: Path) -> dict[str, torch.Tensor]:
    """The CHECK_VARIANT script's matmuls in a process of its own running ``variant`` (skipped where the CPU
    cannot run it)."""
    choice = native_lib.choose_variant(native_lib.cpu_flags(), variant)
    if isinstance(choice, str):
        pytest.skip(choice)
    env = {**os.environ, "PIE_NATIVE_VARIANT": variant}
    script = CHECK_VARIANT.format(variant=variant, out=out)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{variant} ok" in done.stdout
    return torch.load(out)


@pytest.mark.parametrize("variant", [v.name for v in native_lib.VARIANTS])
def test_every_variant_the_cpu_runs_keeps_rows_batch_invariant(variant, tmp_path):
    run_variant(variant, tmp_path / "out.pt")


def test_every_variant_the_cpu_runs_gives_mixed_kind_rows_the_same_bits(tmp_path):
    """WX weights (Q4_K, Q6_K, Q5_1 groups in one weight) make exact int32 sums on every variant (the signed kinds
    move their sign onto x everywhere) and scale them in one order: the variants agree bit for bit."""
    runs = [run_variant_if_runs(v.name, tmp_path / f"{v.name}.pt") for v in native_lib.VARIANTS]
    got = [r["wx"] for r in runs if r is not None]
    assert len(got) >= 2
    for other in got[1:]:
        assert torch.equal(got[0], other)


def test_amx_tiles_give_the_bits_of_the_dpbusd_path(tmp_path):
    """The amx variant multiplies calls of 6+ rows on the tile unit and fewer with dpbusd: both make the same
    int32 sums and scale them in one order, so its results equal avx512vnni's bit for bit at every row count."""
    tiles = run_variant("amx", tmp_path / "amx.pt")
    dpbusd = run_variant("avx512vnni", tmp_path / "vnni.pt")
    for name in ("q4", "q8", "wx"):
        assert torch.equal(tiles[name], dpbusd[name]), name
