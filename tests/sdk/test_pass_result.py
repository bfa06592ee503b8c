"""PassResult's joined arrays: one readout's array as it is, same-shaped rows joined in readout order, and a
clear error (not a numpy one) for readouts whose rows differ in shape."""

from __future__ import annotations

import numpy as np
import pytest

from inferlet.forward import PassResult, ReadoutResult


def test_one_readout_is_returned_as_is():
    mtp = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    res = PassResult([ReadoutResult("mtp", tokens=mtp), ReadoutResult("logits", logits=np.zeros((2, 5)))])
    assert res.tokens is mtp and res.logits.shape == (2, 5) and res.probs is None


def test_same_shaped_rows_join_in_readout_order():
    res = PassResult([ReadoutResult("argmax", tokens=np.array([1, 2])), ReadoutResult("sample", tokens=np.array([3]))])
    assert res.tokens.tolist() == [1, 2, 3]


def test_differently_shaped_rows_name_the_readouts():
    res = PassResult(
        [ReadoutResult("argmax", tokens=np.array([1, 2])), ReadoutResult("mtp", tokens=np.array([[1, 2], [3, 4]]))]
    )
    with pytest.raises(ValueError, match=r"readouts\[0\] \(argmax\).*readouts\[1\] \(mtp\)"):
        _ = res.tokens
