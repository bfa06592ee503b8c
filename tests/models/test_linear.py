"""The models' Linear with a oneDNN-prepacked weight: same outputs as ``F.linear`` for every row count (one
row still goes through MKL), same state-dict names, and no packing where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pie_runtime.models.linear import Linear, prepack, prepack_available, unpack

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def make(in_f: int = 64, out_f: int = 300, bias: bool = True) -> Linear:
    torch.manual_seed(0)
    return Linear(in_f, out_f, bias=bias)


@pytest.mark.parametrize("bias", [True, False])
def test_prepacked_equals_f_linear_for_every_row_count(bias):
    lin = make(bias=bias)
    assert prepack(lin) == lin.weight.numel() * 4
    assert lin.packed is not None
    for rows in range(1, 18):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            got = lin(x)
        want = F.linear(x, lin.weight, lin.bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if rows == 1:
            assert torch.equal(got, want)  # one row takes MKL's path, bit for bit


def test_state_dict_names_are_nn_linear_names():
    lin = make()
    prepack(lin)
    assert set(lin.state_dict()) == {"weight", "bias"}


def test_unpack_and_non_float32_modules_are_left_to_f_linear():
    lin = make()
    prepack(lin)
    unpack(lin)
    assert lin.packed is None
    half = make().to(torch.bfloat16)
    assert not prepack_available(half) and prepack(half) == 0 and half.packed is None
