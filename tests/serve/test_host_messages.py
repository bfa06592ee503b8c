"""A host's text messages are built without pydantic (``control.encode_text``, ``inferlet_host.Chunk``): the
bytes decode, as the server validates them, to the ``Text`` the model would have sent, and text queued for one
run goes out as one message (in order, runs kept apart)."""

from __future__ import annotations

import pytest

from pie_runtime.serve import control as c
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
