"""Limits checked before work, in process (see test_core.py's ``Core``): readout rows, empty masks, sampler
extremes, lying arrays and channel data, each refused with its typed error and nothing changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pie_runtime.engine import sampling
from pie_runtime.engine.channels import MAX_CELL_ELEMENTS, MAX_CHANNEL_ELEMENTS
from pie_runtime.engine.fire_requests import MAX_READOUT_ROWS, MIN_READOUT_ROWS
from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol.arrays import decode_array
from pie_runtime.protocol.messages import MAX_TEMPERATURE, MIN_TEMPERATURE

from .test_core import PROMPT, VOCAB, A, B, Core, logits_of

WORDS = (VOCAB + 31) // 32


def refused(c: Core, code: ErrorCode, op: str, **fields) -> PieError:
    """Asserts the request is refused with ``code`` and changes nothing (free pages, queued fires)."""
    free = c.pages_free()
    queued = c.call(A, "stats")["models"]["tiny"]["queued"]
    with pytest.raises(PieError) as e:
        c.request(A, op, **fields)
    assert e.value.code == code, e.value
    assert c.pages_free() == free
    assert c.call(A, "stats")["models"]["tiny"]["queued"] == queued
    assert not c.core.has_work() or queued
    return e.value


def packed_mask(rows: list[list[int]]) -> dict:
    """Allowed tokens per row → the wire's packed int32 words."""
    words = np.zeros((len(rows), WORDS), dtype=np.uint32)
    for i, allowed in enumerate(rows):
        for t in allowed:
            words[i, t // 32] |= np.uint32(1 << (t % 32))
    return {"dtype": "int32", "shape": [len(rows), WORDS], "data": words.view(np.int32).tobytes()}


def wire(a: np.ndarray) -> dict:
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()}


# ---- readout rows --------------------------------------------------------------------------------


def test_a_readout_reads_at_most_the_window_or_min_readout_rows():
    c = Core()
    ws = c.call(A, "ws_open")["ws"]
    e = refused(
        c, ErrorCode.LIMIT_EXCEEDED, "fire", ws=ws, tokens=[1], readouts=[{"rows": [0] * 300_000, "kind": "argmax"}]
    )
    assert "window 1" in e.message and "MIN_READOUT_ROWS" in e.message
    too_many = [{"rows": [0] * (MIN_READOUT_ROWS + 1), "kind": "argmax"}]
    refused(c, ErrorCode.LIMIT_EXCEEDED, "fire", ws=ws, tokens=[1, 2], readouts=too_many)
    window = list(range(MIN_READOUT_ROWS + 2))
    refused(c, ErrorCode.LIMIT_EXCEEDED, "fire", ws=ws, tokens=window, readouts=[{"rows": [0] * 67, "kind": "argmax"}])
    # duplicates within the bound are fine: several samples of one row, or a long window's rows twice over
    req = c.fire(A, ws, [1, 2], readouts=[{"rows": [1] * MIN_READOUT_ROWS, "kind": "sample", "seed": 1}])
    reply = c.run()[req]
    assert reply["ok"] and decode_array(reply["results"][0]["tokens"]).shape == (MIN_READOUT_ROWS,)
    assert c.pages_free() == 31


def test_the_readouts_of_one_fire_read_at_most_max_readout_rows():
    c = Core()
    ws = c.call(A, "ws_open")["ws"]
    n = MAX_READOUT_ROWS // 4 + 1
    readouts = [{"rows": [0], "kind": "argmax"}] * n
    e = refused(c, ErrorCode.LIMIT_EXCEEDED, "fire", ws=ws, tokens=[1], readouts=readouts * 4)
    assert "MAX_READOUT_ROWS" in e.message
    assert c.call(A, "stats")["working_sets"] == 1


# ---- masks and the sampler -------------------------------------------------------------------------


def test_an_empty_mask_row_is_refused():
    c = Core()
    ws = c.call(A, "ws_open")["ws"]
    for kind in ("sample", "argmax", "distribution", "logits"):
        mask = packed_mask([[3], []])
        e = refused(
            c,
            ErrorCode.EMPTY_MASK,
            "fire",
            ws=ws,
            tokens=[1, 2],
            readouts=[{"rows": [0, 1], "kind": kind, "mask": mask}],
        )
        assert "row 1" in e.message
    # bits past the vocabulary allow nothing
    words = np.zeros((1, WORDS), dtype=np.uint32)
    words[0, -1] = np.uint32(1 << 31)  # token 32 * WORDS - 1 >= VOCAB
    mask = {"dtype": "uint32", "shape": [1, WORDS], "data": words.tobytes()}
    refused(
        c, ErrorCode.EMPTY_MASK, "fire", ws=ws, tokens=[1], readouts=[{"rows": [0], "kind": "sample", "mask": mask}]
    )
    # a mask allowing only the last token of the vocabulary is fine
    req = c.fire(A, ws, [1], readouts=[{"rows": [0], "kind": "sample", "mask": packed_mask([[VOCAB - 1]])}])
    reply = c.run()[req]
    assert reply["ok"] and decode_array(reply["results"][0]["tokens"]).tolist() == [VOCAB - 1]


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": -1.0},
        {"temperature": MAX_TEMPERATURE * 2},
        {"temperature": float("inf")},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": float("nan")},
        {"top_k": -1},
    ],
)
def test_sampler_arguments_out_of_range_are_refused(fields):
    c = Core()
    ws = c.call(A, "ws_open")["ws"]
    # refused by the wire schema, before the engine looks at the fire
    readouts = [{"rows": [0], "kind": "sample", **fields}]
    e = refused(c, ErrorCode.BAD_MESSAGE, "fire", ws=ws, tokens=[1], readouts=readouts)
    assert next(iter(fields)) in e.message


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1e-300},
        {"top_p": 1e-300},
        {"temperature": 1e-300, "top_p": 1e-300},
        {"temperature": MAX_TEMPERATURE, "top_k": 10**9},
        {"temperature": 5e-5, "top_k": 1, "top_p": 1e-30},
    ],
)
def test_sampler_extremes_behave_as_their_limit(fields):
    """A tiny temperature or top_p is greedy: the sample equals the argmax, and the engine lives on."""
    c = Core()
    ws = c.call(A, "ws_open")["ws"]
    readouts = [
        {"rows": [0, 1], "kind": "argmax"},
        {"rows": [0, 1], "kind": "sample", "seed": 3, **fields},
        {"rows": [0, 1], "kind": "distribution", **fields},
    ]
    req = c.fire(A, ws, PROMPT[:2], readouts=readouts)
    reply = c.run()[req]
    assert reply["ok"], reply
    greedy, sampled = (decode_array(reply["results"][i]["tokens"]) for i in (0, 1))
    probs = decode_array(reply["results"][2]["probs"])
    assert np.isfinite(probs).all() and (probs >= 0).all()
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    if fields.get("temperature", 1.0) < MIN_TEMPERATURE or fields.get("top_p", 1.0) < 1e-6:
        assert sampled.tolist() == greedy.tolist()
        np.testing.assert_array_equal(probs.argmax(-1), greedy)


def test_filtered_probs_is_finite_for_any_logits():
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [[1.0, 3, 2, 3, -1], [nan] * 5, [inf, 1, inf, 2, 3], [-inf] * 5, [3e38, -3e38, 0, 1, 2], [nan, 1, -inf, inf, 0]]
    )
    for t in (0.0, 1e-300, 1e-5, MIN_TEMPERATURE, 0.7, 1.0, MAX_TEMPERATURE, 1e300):
        for top_p in (1e-300, 0.5, 1.0):
            for top_k in (0, 1, 3, 10):
                probs = sampling.filtered_probs(logits, t, top_k, top_p)
                assert torch.isfinite(probs).all() and (probs >= 0).all(), (t, top_p, top_k, probs)
                torch.testing.assert_close(probs.sum(-1), torch.ones(len(logits)))
                sampling.sample(probs, 2**64 - 1)  # multinomial accepts every row
    # +inf logits share the row; a row with nothing finite is uniform; NaN never wins
    probs = sampling.filtered_probs(logits, 1.0)
    torch.testing.assert_close(probs[2], torch.tensor([0.5, 0, 0.5, 0, 0]))
    torch.testing.assert_close(probs[3], torch.full((5,), 0.2))
    assert sampling.argmax(logits)[1:].tolist() == [0, 0, 0, 0, 3]


# ---- lying arrays and channel data -----------------------------------------------------------------


@pytest.mark.parametrize(
    "array",
    [
        {"dtype": "int32", "shape": [-1], "data": b"\0" * 8},
        {"dtype": "int32", "shape": [3], "data": b"\0" * 8},
        {"dtype": "int32", "shape": [1], "data": b"\0" * 8},
        {"dtype": "int32", "shape": [2, -1], "data": b"\0" * 8},
        {"dtype": "int32", "shape": [2**62, 2**62], "data": b"\0" * 8},
        {"dtype": "int32", "shape": [True], "data": b"\0" * 4},
    ],
)
def test_a_lying_array_is_refused(array):
    with pytest.raises(PieError) as e:
        decode_array(array)
    assert e.value.code == ErrorCode.BAD_MESSAGE
    c = Core()
    ch = c.call(A, "channel_open", shape=[2], dtype="int32", capacity=2)["channel"]
    with pytest.raises(PieError):
        c.request(A, "channel_put", channel=ch, value=array)
    with pytest.raises(PieError) as e:
        c.request(A, "channel_take", channel=ch)
    assert e.value.code == ErrorCode.CHANNEL_EMPTY  # nothing was put


@pytest.mark.parametrize("op", ["channel_put", "channel_set"])
def test_channel_data_must_match_dtype_and_shape_exactly(op):
    c = Core()
    ch = c.call(A, "channel_open", shape=[2], dtype="int32", capacity=2)["channel"]
    c.call(A, "channel_put", channel=ch, value=wire(np.array([5, 6], np.int32)))
    for bad in (
        np.array([1, 2], np.float16),
        np.array([1, 2], np.uint8),
        np.array([1, 2], np.int64),
        np.array([1, 2], np.float32),
        np.array([1, 2, 3], np.int32),
        np.array([[1, 2]], np.int32),
        np.array(1, np.int32),
    ):
        with pytest.raises(PieError) as e:
            c.request(A, op, channel=ch, value=wire(bad))
        assert e.value.code == ErrorCode.INVALID_ARGUMENT
        assert "int32" in e.value.message
    reply = c.call(A, "channel_take", channel=ch, max=4)
    assert reply["count"] == 1 and decode_array(reply["value"]).tolist() == [[5, 6]]  # unchanged
    assert c.call(A, op, channel=ch, value=wire(np.array([7, 8], np.int32))) == {"size": 1}


def test_channel_sizes_are_bounded():
    c = Core()
    for shape, capacity, limit in (
        ([2**62], 1, "MAX_CELL_ELEMENTS"),
        ([2**31, 2**31, 2**31, 2**31], 1, "MAX_CELL_ELEMENTS"),
        ([MAX_CELL_ELEMENTS + 1], 1, "MAX_CELL_ELEMENTS"),
        ([MAX_CELL_ELEMENTS], MAX_CHANNEL_ELEMENTS // MAX_CELL_ELEMENTS + 1, "MAX_CHANNEL_ELEMENTS"),
        ([64, 64, 64], 4096, "MAX_CHANNEL_ELEMENTS"),
    ):
        with pytest.raises(PieError) as e:
            c.request(A, "channel_open", shape=shape, dtype="float32", capacity=capacity)
        assert e.value.code == ErrorCode.LIMIT_EXCEEDED and limit in e.value.message
    for shape in ([-1], [0], [1, -5]):
        with pytest.raises(PieError) as e:
            c.request(A, "channel_open", shape=shape, dtype="int32", capacity=1)
        assert e.value.code == ErrorCode.INVALID_ARGUMENT
    assert c.call(A, "stats")["channels"] == 0
    c.call(
        A, "channel_open", shape=[MAX_CELL_ELEMENTS], dtype="bool", capacity=MAX_CHANNEL_ELEMENTS // MAX_CELL_ELEMENTS
    )
    assert c.call(A, "stats")["channels"] == 1


def test_a_valid_client_still_decodes_after_the_refusals():
    c = Core()
    ws = c.call(A, "ws_open")["ws"]
    ref = c.fire(A, ws, PROMPT[:5], readouts=[{"rows": [4], "kind": "logits"}], fold=0)
    before = logits_of(c.run()[ref])
    too_many = [{"rows": [0] * (MIN_READOUT_ROWS + 1), "kind": "argmax"}]
    refused(c, ErrorCode.LIMIT_EXCEEDED, "fire", ws=ws, tokens=[1], readouts=too_many)
    refused(
        c,
        ErrorCode.EMPTY_MASK,
        "fire",
        ws=ws,
        tokens=[1],
        readouts=[{"rows": [0], "kind": "sample", "mask": packed_mask([[]])}],
    )
    again = c.fire(A, ws, PROMPT[:5], readouts=[{"rows": [4], "kind": "logits"}], fold=0)
    np.testing.assert_array_equal(logits_of(c.run()[again]), before)


def test_the_engine_sampler_and_the_sdk_twin_agree_at_the_extremes():
    from inferlet.spec.distribution import filter_distribution

    rng = np.random.default_rng(11)
    inf, nan = np.inf, np.nan
    logits = np.concatenate(
        [
            rng.normal(0, 3, size=(4, 37)).astype(np.float32),
            np.array([[inf, 1, inf] + [0] * 34, [nan] * 37, [-inf] * 36 + [nan], [0] * 37], dtype=np.float32),
        ]
    )
    logits[0, 5] = nan
    logits[1, :10] = -inf
    mask = rng.random((len(logits), 37)) < 0.5
    mask[:, 7] = True
    for t in (0.0, 1e-300, 9e-5, MIN_TEMPERATURE, 0.3, 1.0, 50.0, MAX_TEMPERATURE):
        for top_p in (1e-300, 1e-9, 0.3, 0.9, 1.0):
            for top_k in (0, 1, 2, 36, 37, 10**9):
                for m in (None, mask):
                    engine = sampling.filtered_probs(
                        torch.from_numpy(logits), t, top_k, top_p, None if m is None else torch.from_numpy(m)
                    ).numpy()
                    sdk = filter_distribution(logits, t, top_k, top_p, m)
                    assert np.isfinite(sdk).all() and (sdk >= 0).all()
                    np.testing.assert_allclose(sdk.sum(-1), 1.0)
                    np.testing.assert_allclose(engine, sdk, atol=2e-5, err_msg=f"t={t} top_p={top_p} top_k={top_k}")


def test_a_take_waiting_for_more_than_the_capacity_is_refused():
    c = Core()
    ch = c.call(A, "channel_open", shape=[1], dtype="int32", capacity=2)["channel"]
    c.call(A, "channel_put", channel=ch, value=wire(np.array([9], np.int32)))
    with pytest.raises(PieError) as e:
        c.request(A, "channel_take", channel=ch, max=3, min=3)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT and "capacity of 2" in e.value.message
    assert not c.core.channels.waiters
    # a min above max counts as max; a max above the capacity alone only caps what one take returns
    reply = c.call(A, "channel_take", channel=ch, max=2, min=4096)
    assert reply["count"] == 1
    c.call(A, "channel_put", channel=ch, value=wire(np.array([10], np.int32)))
    assert c.call(A, "channel_take", channel=ch, max=4096)["count"] == 1


def test_a_step_finishes_fires_of_at_most_max_readout_rows_together():
    c = Core()
    per_fire = MAX_READOUT_ROWS // (2 * MIN_READOUT_ROWS) + 1  # readouts of MIN_READOUT_ROWS rows: two fires
    readouts = [{"rows": [0] * MIN_READOUT_ROWS, "kind": "argmax"}] * per_fire  # exceed one step's budget
    reqs = [c.fire(client, c.call(client, "ws_open")["ws"], [1], readouts=readouts) for client in (A, B, A)]
    assert [set(c.step()) for _ in reqs] == [{r} for r in reqs]  # one fire a step, in order
    assert not c.core.has_work()
