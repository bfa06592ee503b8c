"""Weight-only quantization (pie_runtime/models/quant.py): GGUF blocks read as gguf itself reads them, the
GroupQuant round trips, and the int4/int8 layers: close to ``x @ w.T`` and batch-invariant bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from pie_runtime.models.quant import (
    GroupQuant,
    Int4Linear,
    Int8Linear,
    QuantError,
    quantize_int4,
    quantize_int8,
)
from pie_runtime.models.quant_kinds import BlockTensor
from pie_runtime.store import packaged_path

KINDS = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q8_0": QT.Q8_0}


def from_gguf(raw: np.ndarray, ggml_type: QT, shape: tuple[int, ...]) -> GroupQuant:
    gq = BlockTensor.from_gguf(raw, ggml_type.name.lower(), shape).group_quant()
    assert gq is not None
    return gq


# Relative L2 error of a quantized layer's bf16 output against float32 x @ dequantize().T: bf16 activations
# and bf16 scales/zeros cost about 0.3% (measured 0.30% int4, 0.27% for a plain bf16 F.linear).
LAYER_RTOL = 0.01


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


# ---- GGUF blocks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_from_gguf_equals_gguf_dequantize_on_synthetic_blocks(kind):
    w = weight(48, 96).numpy()
    w[0, :32] = 0.0  # a constant block: d = 0
    raw = gguf.quants.quantize(w, KINDS[kind])
    gq = from_gguf(raw, KINDS[kind], w.shape)
    assert gq.kind == kind and gq.group == 32 and gq.bits == (8 if kind == "q8_0" else 4)
    assert same_values(gq.dequantize().numpy(), gguf.quants.dequantize(raw, KINDS[kind]))


def test_from_gguf_equals_gguf_dequantize_on_the_packaged_model():
    reader = gguf.GGUFReader(str(packaged_path("smollm2-135m")))
    wanted = {"token_embd.weight", "blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_gate.weight"}
    seen = set()
    for t in reader.tensors:
        if t.name not in wanted:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        got = from_gguf(t.data, t.tensor_type, shape).dequantize().numpy()
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), t.name  # bit for bit
        seen.add(t.tensor_type.name)
    assert seen == {"Q8_0", "Q4_1"}


def test_from_gguf_refuses_what_it_cannot_read():
    raw = gguf.quants.quantize(weight(4, 64).numpy(), QT.Q4_1)
    with pytest.raises(QuantError, match="not a quantized kind"):
        BlockTensor.from_gguf(raw, "f16", (4, 64))
    with pytest.raises(QuantError, match="does not hold"):
        BlockTensor.from_gguf(raw, "q4_1", (8, 64))
    with pytest.raises(QuantError, match="whole blocks of 32"):
        BlockTensor.from_gguf(raw, "q4_1", (8, 48))


# ---- GroupQuant ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_round_trip_cat_and_permute(bits):
    w = weight(40, 64)
    gq = quantize_int4(w) if bits == 4 else q8_0(w)
    packed = gq.packed_q()
    assert packed.shape == ((40, 32) if bits == 4 else (40, 64))
    if bits == 4:  # low nibble first
        assert torch.equal(packed[:, 0], gq.q[:, 0] | (gq.q[:, 1] << 4))
    back = GroupQuant.from_packed(packed, gq.d.half().float(), gq.m.half().float(), bits=bits, group=gq.group)
    assert torch.equal(back.q, gq.q)
    assert gq.nbytes == 40 * 64 * bits // 8 + 2 * 2 * gq.d.numel()

    other = quantize_int4(weight(8, 64, seed=1)) if bits == 4 else q8_0(weight(8, 64, seed=1))
    fused = GroupQuant.cat([gq, other])
    assert torch.equal(fused.dequantize(), torch.cat([gq.dequantize(), other.dequantize()]))

    index = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    assert torch.equal(gq.permute_rows(index).dequantize(), gq.dequantize()[index])


def q8_0(w: torch.Tensor) -> GroupQuant:
    return from_gguf(gguf.quants.quantize(w.numpy(), QT.Q8_0), QT.Q8_0, tuple(w.shape))


def test_cat_refuses_mixed_formats():
    with pytest.raises(QuantError, match="cannot fuse"):
        GroupQuant.cat([quantize_int4(weight(8, 64)), quantize_int8(weight(8, 64))])
    with pytest.raises(QuantError, match="cannot fuse"):
        GroupQuant.cat([quantize_int4(weight(8, 64)), quantize_int4(weight(8, 64), group=64)])


def test_dequantize_in_another_dtype_is_the_float32_value_cast():
    gq = quantize_int4(weight(16, 64))
    assert torch.equal(gq.dequantize(torch.bfloat16), gq.dequantize().to(torch.bfloat16))


def test_quantize_int4_error_is_within_half_a_step():
    w = weight(64, 128)
    gq = quantize_int4(w, group=32)
    assert gq.q.max() <= 15 and gq.group == 32
    step = gq.d.repeat_interleave(32, dim=1)
    assert bool(((gq.dequantize() - w).abs() <= step / 2 + 1e-6).all())
    const = quantize_int4(torch.full((16, 32), 0.25))  # d = 0: every weight is m
    assert torch.equal(const.dequantize(), torch.full((16, 32), 0.25))


def test_quantize_int8_is_per_channel_with_bf16_exact_scales():
    w = weight(64, 96)
    gq = quantize_int8(w)
    assert gq.group == 96 and gq.symmetric and int(gq.q.abs().max()) <= 127
    assert torch.equal(gq.d.to(torch.bfloat16).float(), gq.d)  # the kernel's bf16 scale is exact
    assert bool(((gq.dequantize() - w).abs() <= gq.d / 2 + 1e-7).all())


# ---- layers ----------------------------------------------------------------------------------------------


def _layers() -> list[tuple[str, torch.nn.Module, torch.Tensor]]:
    """(name, layer, its dequantized float32 weight) for each way a layer is built."""
    w, w2 = weight(1536, 576), weight(72, 64, seed=5)  # 72 rows: not a multiple of 16, padded for int4
    q41 = from_gguf(gguf.quants.quantize(w.numpy(), QT.Q4_1), QT.Q4_1, (1536, 576))
    q40 = from_gguf(gguf.quants.quantize(w2.numpy(), QT.Q4_0), QT.Q4_0, (72, 64))
    q80 = from_gguf(gguf.quants.quantize(w.numpy(), QT.Q8_0), QT.Q8_0, (1536, 576))
    i8 = quantize_int8(w.t().contiguous())  # 576 x 1536
    return [
        ("int4 q4_1", Int4Linear(q41), q41.dequantize()),
        ("int4 q4_0 padded", Int4Linear(q40), q40.dequantize()),
        ("int4 quantized here", Int4Linear(quantize_int4(w2)), quantize_int4(w2).dequantize()),
        ("int8 per channel", Int8Linear(i8), i8.dequantize()),
        ("int8 from q8_0", Int8Linear(q80), q80.dequantize()),
    ]


@pytest.fixture(scope="module")
def layers():
    return _layers()


def test_layers_match_the_dequantized_matmul(layers):
    torch.manual_seed(0)
    for name, layer, w in layers:
        x = torch.randn(9, layer.in_features)
        with torch.inference_mode():
            y = layer(x.to(torch.bfloat16))
        assert y.dtype == torch.bfloat16 and y.shape == (9, layer.out_features), name
        assert rel_err(y, x @ w.t()) < LAYER_RTOL, name
        assert (layer.in_features, layer.out_features) == (w.shape[1], w.shape[0])
        assert 0 < layer.weight_bytes < w.numel() * 2, name  # less than bf16


def test_layers_are_batch_invariant(layers):
    """Row i of an M-row call equals the 1-row call bit for bit, for every M in 2..64."""
    torch.manual_seed(1)
    for name, layer, _ in layers:
        x = torch.randn(64, layer.in_features).to(torch.bfloat16)
        with torch.inference_mode():
            single = torch.cat([layer(x[i : i + 1]) for i in range(64)])
            for m in range(2, 65):
                assert torch.equal(layer(x[:m]), single[:m]), f"{name}: {m} rows"


def test_bias_and_leading_dims():
    gq = quantize_int4(weight(32, 64))
    bias = torch.randn(32)
    x = torch.randn(2, 3, 64)
    want = x @ gq.dequantize().t() + bias
    for layer in (Int4Linear(gq, bias), Int8Linear(quantize_int8(gq.dequantize()), bias)):
        with torch.inference_mode():
            y = layer(x.to(torch.bfloat16))
        assert y.shape == (2, 3, 32) and rel_err(y, want) < LAYER_RTOL


def test_layers_refuse_float32_activations_and_wrong_bits():
    gq = quantize_int4(weight(32, 64))
    with pytest.raises(TypeError, match="bfloat16"):
        Int4Linear(gq)(torch.randn(1, 64))
    with pytest.raises(QuantError):
        Int8Linear(gq)
    with pytest.raises(QuantError):
        Int4Linear(quantize_int8(weight(32, 64)))


def test_other_devices_use_a_dequantized_bf16_weight():
    """Off the CPU (CUDA) the layers hold the bf16 dequantized weight; the meta device runs that path here."""
    gq4, gq8 = quantize_int4(weight(32, 64)), quantize_int8(weight(32, 64))
    for layer, gq in ((Int4Linear(gq4, device="meta"), gq4), (Int8Linear(gq8, device="meta"), gq8)):
        assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
        assert layer.weight_bytes == gq.q.numel() * 2
        y = layer(torch.empty(3, 64, dtype=torch.bfloat16, device="meta"))
        assert y.shape == (3, 32) and y.device.type == "meta"
