"""``--tensor-parallel 2`` over gloo (two ranks, one thread each) against one rank: the same greedy tokens over
64 steps, and float32 logits within 1e-4, on the tiny model; fp32 only, other formats refused."""

from __future__ import annotations

import numpy as np
import pytest

import inferlet
from pie_runtime.launcher import LaunchError
from tests.conftest import TINY, start_engine

PROMPT = [1, 420, 77, 3141, 5926, 535, 8979, 3238, 4626, 4338]


async def greedy_logits(address: str, steps: int = 64) -> tuple[list[int], np.ndarray]:
    session = await inferlet.connect(address)
    try:
        ws = inferlet.model(TINY).working_set()
        window, tokens, rows = list(PROMPT), [], []
        for _ in range(steps):
            fp = inferlet.ForwardPass(ws)
            fp.embed(window).readout([len(window) - 1], inferlet.Logits())
            logits = (await fp.submit()).logits
            assert logits is not None
            rows.append(logits[0])
            tokens.append(int(np.argmax(logits[0])))
            window = [tokens[-1]]
        await ws.release()
        return tokens, np.stack(rows)
    finally:
        session.client.close()


async def test_two_ranks_equal_one(pie_home):
    one = start_engine(pie_home, [TINY], "--threads", "1", "--pass-cost-rows", "0")
    two = start_engine(pie_home, [TINY], "--threads", "1", "--pass-cost-rows", "4", "--tensor-parallel", "2")
    try:
        tokens1, logits1 = await greedy_logits(one.address)
        tokens2, logits2 = await greedy_logits(two.address)
    finally:
        one.stop()
        two.stop()
    assert tokens2 == tokens1
    assert logits2.shape == logits1.shape == (64, 49152)
    assert float(np.abs(logits2 - logits1).max()) < 1e-4


def test_other_weight_formats_are_refused(pie_home):
    with pytest.raises(LaunchError, match="fp32 only"):
        start_engine(pie_home, [TINY], "--tensor-parallel", "2", "--weights", "bf16")
