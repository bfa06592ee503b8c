"""Page allocation and the scheduler's plan: counts and handles only."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pie_runtime.engine.page_pool import PagePool
from pie_runtime.engine.scheduler import schedule
from pie_runtime.protocol import ErrorCode, PieError


def test_alloc_share_release():
    pool = PagePool(4)
    a = pool.alloc(3)
    assert pool.free_pages == 1 and len(set(a)) == 3
    pool.share(a[:2])
    pool.release(a)
    assert pool.free_pages == 2  # the two shared pages are still held once
    pool.release(a[:2])
    assert pool.free_pages == 4


def test_alloc_is_all_or_nothing():
    pool = PagePool(2)
    pool.alloc(1)
    with pytest.raises(PieError) as e:
        pool.alloc(2)
    assert e.value.code == ErrorCode.OUT_OF_PAGES
    assert pool.free_pages == 1


@dataclass(eq=False)  # compared by identity: two jobs alike are still two fires
class Job:
    ws: object
    remaining: int
    readout_rows: int = 0


def job(ws, remaining):
    return Job(ws, remaining)


def test_schedule_decode_first_and_chunks_prefill():
    a, b, c = object(), object(), object()
    long_fire, decode1, decode2 = job(a, 1000), job(b, 1), job(c, 3)
    chunks = schedule([long_fire, decode1, decode2], max_batch_tokens=64)
    assert [(ch.job, ch.rows) for ch in chunks] == [(decode1, 1), (decode2, 3), (long_fire, 60)]


def test_schedule_runs_one_fire_per_working_set_in_order():
    ws = object()
    first, second = job(ws, 2), job(ws, 2)
    chunks = schedule([first, second], max_batch_tokens=64)
    assert [ch.job for ch in chunks] == [first]
