"""A working set's K/V read out (``ws_read_kv``) and appended to a working set of another engine core
(``ws_append_kv``, engine/kv_transfer.py): the bits and the positions survive, a continuation gives the same
logits bit for bit, the prefix cache names none of the loaded rows, and the refusals are typed and change nothing.
In process on the tiny model (tests/engine/test_core.py's Core); two Cores stand for two engines (the same seed,
the same weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol import messages as m
from pie_runtime.protocol.arrays import decode_array, encode_array

from .test_core import PROMPT, A, Core, logits_of
from .test_evict import kv_rows, prefilled

NEXT = [5, 6]
LOGITS = [{"rows": [0, 1], "kind": "logits"}]


def read_all(c: Core, ws: int, chunk: int = 7) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """Every committed row's K/V, ``chunk`` rows a request; and the working set's dropped rows."""
    out, start, dropped = [], 0, 0
    committed = c.core.sets.get(A, ws).committed
    while start < committed:
        reply = c.call(A, "ws_read_kv", ws=ws, start=start, count=min(chunk, committed - start))
        k, v = decode_array(reply["k"]), decode_array(reply["v"])
        assert reply["kv_dtype"] == "float32" and k.shape == v.shape == (2, 2, k.shape[2], 8)
        out.append((k, v))
        start, dropped = start + k.shape[2], reply["dropped"]
    return out, dropped


def load(c: Core, chunks: list[tuple[np.ndarray, np.ndarray]], dropped: int) -> tuple[int, dict]:
    ws = c.call(A, "ws_open")["ws"]
    reply: dict = {}
    for k, v in chunks:
        fields = {"k": encode_array(k), "v": encode_array(v), "kv_dtype": "float32", "dropped": dropped}
        reply = c.call(A, "ws_append_kv", ws=ws, **fields)
    return ws, reply


def continuation(c: Core, ws: int) -> np.ndarray:
    req = c.fire(A, ws, NEXT, readouts=LOGITS)
    return logits_of(c.run()[req])


def test_rows_travel_bit_for_bit_and_continue_alike_and_the_cache_names_none():
    saved, loaded = Core(), Core()
    src = prefilled(saved)
    chunks, dropped = read_all(saved, src)
    assert [k.shape[2] for k, _ in chunks] == [7, 7, 7, 7, 2] and dropped == 0
    dst, reply = load(loaded, chunks, dropped)
    assert (reply["committed"], reply["dropped"], reply["pages"]) == (30, 0, 8)
    kv = loaded.call(A, "stats")["models"]["tiny"]["kv"]  # one restore of 30 rows, in 5 appends
    assert (kv["restored_working_sets"], kv["restored_rows"], kv["evicted_rows"]) == (1, 30, 0)
    assert torch.equal(kv_rows(loaded, dst, list(range(30))), kv_rows(saved, src, list(range(30))))
    np.testing.assert_array_equal(continuation(loaded, dst), continuation(saved, src))
    fresh = loaded.call(A, "ws_open")["ws"]
    req = loaded.fire(A, fresh, PROMPT + NEXT + [1])
    assert loaded.run()[req]["cached_rows"] == 0  # the loaded rows (and the ones after them) have no names


def test_positions_survive_an_eviction_then_a_save_and_a_load():
    saved, loaded = Core(), Core()
    src = prefilled(saved)
    saved.call(A, "ws_evict", ws=src, ranges=[[4, 12]])
    chunks, dropped = read_all(saved, src, chunk=64)
    assert dropped == 8
    dst, reply = load(loaded, chunks, dropped)
    assert (reply["committed"], reply["dropped"]) == (22, 8)  # the next row's position: 30, as it was
    np.testing.assert_array_equal(continuation(loaded, dst), continuation(saved, src))


def test_a_read_is_cut_to_the_transfer_limit(monkeypatch):
    c = Core()
    ws = prefilled(c)
    row_bytes = 2 * 2 * 2 * 8 * 4  # K and V, 2 layers, 2 heads, head_dim 8, float32
    monkeypatch.setattr(m, "MAX_KV_TRANSFER_BYTES", 3 * row_bytes)
    reply = c.call(A, "ws_read_kv", ws=ws, start=0, count=30)
    assert decode_array(reply["k"]).shape[2] == 3


def refused(c: Core, op: str, code: ErrorCode, **fields) -> None:
    with pytest.raises(PieError) as e:
        c.call(A, op, **fields)
    assert e.value.code == code, (op, fields, e.value)


def test_mismatched_arrays_are_refused_kv_mismatch_and_change_nothing():
    c = Core()
    ws = c.call(A, "ws_open")["ws"]
    k = np.zeros((2, 2, 3, 8), np.float32)
    free = c.pages_free()
    for kk, vv, dtype in (
        (k.astype(np.float16), k.astype(np.float16), "float16"),  # another pool's dtype
        (k, k, "bfloat16"),  # the bits claim another dtype
        (np.zeros((2, 1, 3, 8), np.float32), np.zeros((2, 1, 3, 8), np.float32), "float32"),  # another model's heads
        (np.zeros((3, 2, 3, 8), np.float32), np.zeros((3, 2, 3, 8), np.float32), "float32"),  # an EAGLE layer more
        (k, np.zeros((2, 2, 4, 8), np.float32), "float32"),  # k and v differ
        (np.zeros((2, 2, 8), np.float32), np.zeros((2, 2, 8), np.float32), "float32"),
    ):
        refused(c, "ws_append_kv", ErrorCode.KV_MISMATCH, ws=ws, k=encode_array(kk), v=encode_array(vv), kv_dtype=dtype)
    assert c.core.sets.get(A, ws).committed == 0 and c.pages_free() == free


def test_a_full_pool_is_out_of_pages_and_other_refusals_are_typed():
    saved, small = Core(), Core(num_pages=4)
    src = prefilled(saved)
    (chunk,), _ = read_all(saved, src, chunk=30)
    ws = small.call(A, "ws_open")["ws"]
    free = small.pages_free()
    fields = {"k": encode_array(chunk[0]), "v": encode_array(chunk[1]), "kv_dtype": "float32"}
    refused(small, "ws_append_kv", ErrorCode.OUT_OF_PAGES, ws=ws, **fields)  # 30 rows want 8 pages of 4
    assert small.core.sets.get(A, ws).committed == 0 and small.pages_free() == free
    refused(saved, "ws_append_kv", ErrorCode.CAPACITY, ws=src, dropped=90, **fields)  # 60 + 90 rows > 128
    refused(saved, "ws_read_kv", ErrorCode.ROW_OUT_OF_RANGE, ws=src, start=25, count=6)
    saved.call(A, "ws_evict", ws=src, rows=[0])
    refused(saved, "ws_append_kv", ErrorCode.INVALID_ARGUMENT, ws=src, dropped=0, **fields)  # below its 1 dropped
    saved.fire(A, src, [1], fold="deferred")
    refused(saved, "ws_read_kv", ErrorCode.BUSY, ws=src, count=1)  # in flight
    refused(saved, "ws_append_kv", ErrorCode.BUSY, ws=src, **fields)
    saved.run()
    refused(saved, "ws_read_kv", ErrorCode.FOLD_PENDING, ws=src, count=1)
    refused(saved, "ws_append_kv", ErrorCode.FOLD_PENDING, ws=src, **fields)
    assert saved.core.sets.get(A, src).committed == 29


def test_recurrent_state_and_an_eagle_layer_are_refused_unsupported():
    c = Core()
    ws = prefilled(c)
    served = c.core.models["tiny"]
    served.runner.eagle = object()  # type: ignore[assignment]  # any head: the pool carries its layer
    refused(c, "ws_read_kv", ErrorCode.UNSUPPORTED, ws=ws, count=1)
    served.runner.eagle = None
    served.info.recurrent = True
    k = encode_array(np.zeros((2, 2, 1, 8), np.float32))
    refused(c, "ws_append_kv", ErrorCode.UNSUPPORTED, ws=ws, k=k, v=k, kv_dtype="float32")
