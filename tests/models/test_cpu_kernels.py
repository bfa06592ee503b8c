"""The AVX2 kernel for int8 layers (pie_runtime/models/cpu_kernels.py): used where it is meant to be, the same
products as torch's kernel, batch-invariant bit for bit, a slice of a head gives the head's bits, and without a
compiler (or when declined) the layers fall back to torch's kernel with the reason logged."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from pie_runtime.models import cpu_kernels
from pie_runtime.models.quant import Int8Linear, quantize_int8

needs_kernel = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason=f"the AVX2 kernel is not for this machine ({cpu_kernels.unavailable() or 'it did not build'})",
)
OUT = 4099  # not a multiple of 4: the kernel's last outputs go one at a time


def head_layer(seed: int = 0) -> Int8Linear:
    g = torch.Generator().manual_seed(seed)
    return Int8Linear(quantize_int8(torch.randn(OUT, 576, generator=g) * 0.05))


@pytest.fixture
def fresh_library():
    """library() decided again inside the test, and again after it (for the rest of the session)."""
    cpu_kernels.library.cache_clear()
    yield
    cpu_kernels.library.cache_clear()


@needs_kernel
def test_int8_layers_run_the_kernel_where_their_rows_fit_it():
    assert head_layer().kernel
    assert Int8Linear(quantize_int8(torch.randn(7, 64))).kernel
    assert not Int8Linear(quantize_int8(torch.randn(64, 40))).kernel  # K not a multiple of 32: torch's
    assert copy.deepcopy(head_layer()).kernel  # a model on the kernel can still be copied (the teacher copies one)


@needs_kernel
def test_the_kernel_computes_torchs_products_and_is_batch_invariant():
    layer = head_layer()
    torch.manual_seed(0)
    x = torch.randn(17, 576).to(torch.bfloat16)
    with torch.inference_mode():
        single = torch.cat([layer(x[i : i + 1]) for i in range(17)])
        for m in range(2, 18):  # tiles of 4 rows, then 3, 2 or 1
            assert torch.equal(layer(x[:m]), single[:m]), f"{m} rows"
        ours = layer(x).float()
        layer.kernel = False
        theirs = layer(x).float()
    # both round float32 sums of the same products to bf16: they differ in the last bits only
    assert float((ours - theirs).norm() / theirs.norm()) < 2e-3
    assert float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()) >= 0.9


@needs_kernel
def test_a_slice_of_a_head_gives_the_heads_bits():
    layer = head_layer(seed=1)
    ids = torch.tensor([0, 7, 4096, OUT - 1, 1000])
    part = layer.rows(ids)
    assert part.kernel and layer.kernel
    x = torch.randn(5, 576).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(part(x), layer(x)[:, ids])


def test_declined_kernels_leave_torchs(fresh_library, monkeypatch, caplog):
    monkeypatch.setenv("PIE_CPU_KERNELS", "torch")
    with caplog.at_level(logging.INFO, logger="pie.kernels"):
        assert cpu_kernels.library() is None
    assert "PIE_CPU_KERNELS=torch" in caplog.text
    assert not head_layer().kernel


def test_a_failed_build_falls_back_with_the_reason(fresh_library, monkeypatch, tmp_path, caplog):
    if cpu_kernels.unavailable() is not None:
        pytest.skip(f"not an AVX2 machine ({cpu_kernels.unavailable()})")
    monkeypatch.setenv("PIE_HOME", str(tmp_path))  # no library built there yet
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with caplog.at_level(logging.INFO, logger="pie.kernels"):
        assert cpu_kernels.library() is None
    assert "failed" in caplog.text and "torch's kernel" in caplog.text
    layer = head_layer()
    assert not layer.kernel
    with torch.inference_mode():
        assert layer(torch.randn(2, 576).to(torch.bfloat16)).shape == (2, OUT)


@needs_kernel
def test_a_compiled_graph_holds_the_kernel_as_one_op():
    layer = Int8Linear(quantize_int8(torch.randn(96, 64) * 0.05))

    def f(x: torch.Tensor) -> torch.Tensor:
        return layer(torch.nn.functional.silu(x)) * 2

    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        explained = torch._dynamo.explain(f)(x)
        assert explained.graph_break_count == 0
        assert torch.equal(torch.compile(f)(x), f(x))
