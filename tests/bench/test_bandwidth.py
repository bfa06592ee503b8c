"""bench/bandwidth.py's count of the bytes a pie decode token streams: each kind's WX record size is what the
packer makes, and a fused weight's parts count by their own sizes."""

from __future__ import annotations

import pytest

from pie_runtime.bench.bandwidth import NATIVE_BYTES, WX_BYTES, native_bytes
from pie_runtime.models import native_lib
from pie_runtime.models.native_linear import PackedWeight
from tests.models.quant_blocks import random_blocks


def test_a_fused_weights_parts_count_by_their_sizes():
    """q (Q4_K, 4x the weights) beside k and v (Q6_K): weighted by size, not the mean of the three kinds."""
    q, kv = 2048 * 2048, 512 * 2048
    got = native_bytes([("q4_k", q), ("q6_k", kv), ("q6_k", kv)], "gguf")
    assert got == pytest.approx(q * WX_BYTES["q4_k"] + 2 * kv * WX_BYTES["q6_k"])
    unweighted = (q + 2 * kv) * (WX_BYTES["q4_k"] + 2 * WX_BYTES["q6_k"]) / 3
    assert abs(got - unweighted) > 0.05 * got
    assert native_bytes([("", q), ("q4_k", kv)], "gguf") == pytest.approx(q * WX_BYTES["q8_0"] + kv * WX_BYTES["q4_k"])
    assert native_bytes([("q4_0", q), ("q4_1", kv)], "int4") == pytest.approx((q + kv) * NATIVE_BYTES["q4"])


@pytest.mark.skipif(not native_lib.available(), reason="no native kernels here")
@pytest.mark.parametrize("kind", sorted(WX_BYTES))
def test_each_kinds_record_bytes_are_the_packers(kind):
    rows, k = 64, 2048
    packed = PackedWeight.pack_blocks([random_blocks(kind, rows, k, seed=1)])
    header = 8 * rows // 8
    assert packed.nbytes - header == rows * k * WX_BYTES[kind]
