"""Eviction (``ws_evict``, engine/kv_pages.py ``evict``): committed rows dropped, the kept rows moved up with
their K/V bits and their positions, pages freed at once, whole pages moved without a copy, forks and the prefix
cache left intact, and the typed refusals. In process on the tiny model (tests/engine/test_core.py's Core)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pie_runtime.protocol import ErrorCode, PieError

from .test_core import PAGE, PROMPT, A, Core, logits_of


def kv_rows(c: Core, ws_id: int, rows: list[int]) -> torch.Tensor:
    """The K and V of ``rows`` of a working set, every layer and head: (2, layers, heads, len(rows), head_dim)."""
    served = c.core.models["tiny"]
    pages = c.core.sets.get(A, ws_id).pages
    slots = torch.tensor([pages[r // PAGE] * PAGE + r % PAGE for r in rows])
    kv = served.runner.kv
    return torch.stack([kv.k[:, :, slots], kv.v[:, :, slots]]).clone()


def prefilled(c: Core, tokens: list[int] = PROMPT) -> int:
    ws = c.call(A, "ws_open")["ws"]
    c.fire(A, ws, tokens)
    c.run()
    return ws


def test_the_kept_rows_move_up_with_their_bits_and_the_pages_come_back():
    c = Core(num_pages=32)
    ws = prefilled(c)  # 30 rows: 8 pages
    keep = [0, 1, 2, *range(12, 30)]
    before = kv_rows(c, ws, keep)
    free = c.pages_free()
    reply = c.call(A, "ws_evict", ws=ws, rows=[3], ranges=[[4, 12]])
    assert (reply["committed"], reply["dropped"], reply["pages"]) == (21, 9, 6)
    assert reply["freed"] == 2 and c.pages_free() == free + 2
    assert torch.equal(kv_rows(c, ws, list(range(21))), before)
    kv = c.call(A, "stats")["models"]["tiny"]["kv"]  # the running totals /metrics shows
    assert (kv["evicted_rows"], kv["evicted_pages"], kv["restored_working_sets"]) == (9, 2, 0)


def test_the_next_row_sits_at_the_logical_length():
    """Evicting the last rows and firing equals truncating and firing at the position past them: the same logits,
    bit for bit, so the kept rows and the new row's rotation are what the position rule says."""
    evicted, truncated = Core(), Core()
    a, b = prefilled(evicted), prefilled(truncated)
    evicted.call(A, "ws_evict", ws=a, ranges=[[26, 30]])
    truncated.call(A, "ws_truncate", ws=b, n=26)
    got = evicted.fire(A, a, [5, 6], readouts=[{"rows": [0, 1], "kind": "logits"}])
    want = truncated.fire(A, b, [5, 6], positions=[30, 31], readouts=[{"rows": [0, 1], "kind": "logits"}])
    np.testing.assert_array_equal(logits_of(evicted.run()[got]), logits_of(truncated.run()[want]))
    reply = evicted.call(A, "ws_evict", ws=a, rows=[0])
    assert (reply["committed"], reply["dropped"]) == (27, 5)


def test_whole_pages_move_without_a_copy(monkeypatch):
    c = Core(num_pages=32)
    ws = prefilled(c)
    served = c.core.models["tiny"]
    copied: list[int] = []
    real = served.pages.copy_slots
    monkeypatch.setattr(served.pages, "copy_slots", lambda s, d: (copied.extend(s), real(s, d)))
    before = c.core.sets.get(A, ws).pages[:]
    c.call(A, "ws_evict", ws=ws, ranges=[[2 * PAGE, 4 * PAGE]])  # pages 2 and 3
    assert copied == [] and c.core.sets.get(A, ws).pages == before[:2] + before[4:]
    c.call(A, "ws_evict", ws=ws, ranges=[[1, PAGE + 1]])  # shifts by a page: only the first page is rebuilt
    assert len(copied) == PAGE


def test_a_fork_and_the_prefix_cache_keep_the_rows_they_had():
    c = Core(num_pages=64)
    parent = prefilled(c)
    child = c.call(A, "ws_fork", ws=parent)["ws"]
    parent_rows = kv_rows(c, parent, list(range(30)))
    c.call(A, "ws_evict", ws=child, ranges=[[1, 10]])
    assert torch.equal(kv_rows(c, parent, list(range(30))), parent_rows)  # shared pages were never written
    assert torch.equal(kv_rows(c, child, list(range(21))), parent_rows[:, :, :, [0, *range(10, 30)]])
    # the child's new rows sit at other positions than their index: the cache names none of them, so a request
    # for the parent's tokens and more maps only the parent's own pages
    c.fire(A, child, PROMPT[:8])
    c.run()
    fresh = c.call(A, "ws_open")["ws"]
    req = c.fire(A, fresh, PROMPT + PROMPT[:8] + [1])
    assert c.run()[req]["cached_rows"] <= 28


def test_refusals_are_typed_and_change_nothing():
    c = Core()
    ws = prefilled(c)
    for fields, code in (
        ({"rows": [30]}, ErrorCode.ROW_OUT_OF_RANGE),
        ({"ranges": [[20, 31]]}, ErrorCode.ROW_OUT_OF_RANGE),
        ({"ranges": [[5, 4]]}, ErrorCode.BAD_MESSAGE),
        ({"ranges": [[1, 2, 3]]}, ErrorCode.BAD_MESSAGE),
    ):
        with pytest.raises(PieError) as e:
            c.call(A, "ws_evict", ws=ws, **fields)
        assert e.value.code == code, fields
    c.fire(A, ws, [1], fold="deferred")
    with pytest.raises(PieError) as e:
        c.call(A, "ws_evict", ws=ws, rows=[0])
    assert e.value.code == ErrorCode.BUSY  # in flight
    c.run()
    with pytest.raises(PieError) as e:
        c.call(A, "ws_evict", ws=ws, rows=[0])
    assert e.value.code == ErrorCode.FOLD_PENDING
    c.call(A, "ws_fold", ws=ws, n=1)
    assert c.call(A, "ws_evict", ws=ws, rows=[])["committed"] == 31
