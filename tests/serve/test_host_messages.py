"""A host's text messages are built without pydantic (``control.encode_text``, ``inferlet_host.Chunk``): the
bytes decode, as the server validates them, to the ``Text`` the model would have sent, and text queued for one
run goes out as one message (in order, runs kept apart); on the server, a run's text events that queued up behind
its consumer are given as one event (one SSE frame)."""

from __future__ import annotations

import asyncio

import pytest

from pie_runtime.serve import control as c
from pie_runtime.serve.host_pool import RunEvent, RunFailed, _joined
from pie_runtime.serve.inferlet_host import Chunk, _coalesce

LOGPROBS = [{"id": 3, "logprob": -0.5}]


@pytest.mark.parametrize("text,logprobs", [("hi", None), ('é😀\n"\\', None), ("", LOGPROBS)])
def test_encode_text_is_the_models_message(text, logprobs):
    sent = c.decode_to_server(c.encode_text("run-1", text, logprobs))
    assert sent == c.Text(run="run-1", text=text, logprobs=logprobs)
    assert sent == c.decode_to_server(c.encode(c.Text(run="run-1", text=text, logprobs=logprobs)))


def test_queued_text_of_a_run_goes_as_one_message():
    hb = c.Heartbeat()
    batch = [Chunk("a", "x"), Chunk("a", "y", LOGPROBS), Chunk("b", "z"), hb, Chunk("a", "w"), Chunk("a", "v")]
    assert _coalesce(batch) == [Chunk("a", "xy", LOGPROBS), Chunk("b", "z"), hb, Chunk("a", "wv")]


def test_text_events_queued_behind_a_consumer_become_one_event_and_the_next_other_is_held():
    q: asyncio.Queue = asyncio.Queue()
    result = RunEvent("result", result={"text": "xyz"})
    for ev in (RunEvent("text", "y", logprobs=LOGPROBS), RunEvent("text", "z"), result, RunEvent("text", "late")):
        q.put_nowait(ev)
    assert _joined(RunEvent("text", "x"), q) == (RunEvent("text", "xyz", logprobs=LOGPROBS), result)
    assert q.qsize() == 1  # what follows the held event stays queued
    failed = RunFailed("host_crashed", "gone")
    q = asyncio.Queue()
    q.put_nowait(failed)
    assert _joined(RunEvent("text", "x"), q) == (RunEvent("text", "x"), failed)
    alone = RunEvent("text", "x", logprobs=LOGPROBS)
    assert _joined(alone, asyncio.Queue())[0] is alone
