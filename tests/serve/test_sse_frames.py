"""A streamed token's SSE frame is spliced into a chunk rendered once (``streams.spliced``): byte for byte the
frame the pydantic chunk would give, for either dialect and any text JSON must escape."""

from __future__ import annotations

import pytest

from pie_runtime.serve.openai_api import ChatChunk, ChatChunkChoice, ChatDelta, CompletionChoice, CompletionChunk
from pie_runtime.serve.streams import spliced, sse

TEXTS = ["hi", " world", 'é😀\n"\\', "\x00", "\u2028", "", "</script>"]


def chat(text: str) -> str:
    return sse(
        ChatChunk(id="c", created=1, model="m", choices=[ChatChunkChoice(index=0, delta=ChatDelta(content=text))])
    )


def completion(text: str) -> str:
    return sse(CompletionChunk(id="c", created=1, model="m", choices=[CompletionChoice(index=0, text=text)]))


@pytest.mark.parametrize("render", [chat, completion])
def test_a_spliced_frame_is_the_rendered_one(render):
    frame = spliced(render)
    assert [frame(t) for t in TEXTS] == [render(t) for t in TEXTS]


def test_a_chunk_without_its_text_is_refused():
    with pytest.raises(AssertionError):
        spliced(lambda text: "data: {}\n\n")
