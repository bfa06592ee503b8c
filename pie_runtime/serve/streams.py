"""OpenAI responses from an inferlet run: the whole response for ``stream: false``, and the server-sent
events for ``stream: true`` (``data: {chunk}`` lines, a usage chunk with ``stream_options.include_usage``,
then ``data: [DONE]``).

Streaming follows the run's text events (choice 0). With ``n > 1`` the other choices come whole in one chunk
each when the run ends. When the run's final text extends what was streamed (a stop string held back, text
the inferlet did not emit), the rest is sent before the finishing chunk. With ``logprobs`` each chunk carries
its tokens' logprobs (and top_logprobs) in its dialect's shape, the finishing chunk those not yet sent. A run
that fails mid-stream (its engine died, say) ends the stream with an error object, then ``[DONE]``, as vLLM
does: OpenAI's clients raise the error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferlet.tokenizer import Tokenizer

from .errors import APIError
from .generation import (
    Job,
    chat_logprobs,
    choices_of,
    completion_logprobs,
    entries,
    finish,
    speculation,
    usage,
)
from .openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatDelta,
    ChatRequest,
    ChatResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)

log = logging.getLogger("pie.serve")


def sse(obj: Any) -> str:
    data = obj.model_dump(exclude_none=True) if hasattr(obj, "model_dump") else obj
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def spliced(render: Callable[[str], str]) -> Callable[[str], str]:
    """A function equal to ``render`` (text → the SSE frame of a chunk carrying it) that renders the chunk
    once, then splices each text's JSON string into it: a streamed token costs one ``json.dumps`` of its
    text, not a pydantic model built and dumped."""
    probe = "\x00pie\x00"
    head, found, tail = render(probe).partition(json.dumps(probe))
    assert found, "the chunk does not carry its text as one JSON string"
    return lambda text: head + json.dumps(text) + tail


def _ids(choice: dict, wanted: bool) -> list[int] | None:
    return [int(i) for i in choice.get("token_ids") or []] if wanted else None


def completion_response(
    rid: str, model: str, tok: Tokenizer, job: Job, result: dict, token_ids: bool = False
) -> CompletionResponse:
    choices = [
        CompletionChoice(
            index=i,
            text=(job.echo or "") + c.get("text", ""),
            logprobs=completion_logprobs(tok, entries(c)),
            finish_reason=finish(c),
            token_ids=_ids(c, token_ids),
        )
        for i, c in enumerate(choices_of(result))
    ]
    return CompletionResponse(choices=choices, **_envelope(rid, model, job, result))


def chat_response(
    rid: str, model: str, tok: Tokenizer, job: Job, result: dict, token_ids: bool = False
) -> ChatResponse:
    choices = [
        ChatChoice(
            index=i,
            message=AssistantMessage(content=c.get("text", "")),
            logprobs=chat_logprobs(tok, entries(c)),
            finish_reason=finish(c),
            token_ids=_ids(c, token_ids),
        )
        for i, c in enumerate(choices_of(result))
    ]
    return ChatResponse(choices=choices, **_envelope(rid, model, job, result))


def _envelope(rid: str, model: str, job: Job, result: dict) -> dict[str, Any]:
    """The fields a whole completion and a whole chat response share."""
    return {
        "id": rid,
        "created": int(time.time()),
        "model": model,
        "usage": usage(result, job.prompt_tokens),
        "speculation": speculation(result),
    }


async def _events(first: Any, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for ev in events:
        yield ev


async def _stream(
    chunk: Callable[..., str],
    delta: Callable[[str, list[dict]], Any],
    final: Callable[[int, str, dict, list[dict]], Any],
    include_usage: bool,
    job: Job,
    first: Any,
    events: AsyncIterator[Any],
) -> AsyncIterator[str]:
    """The SSE lines of a run in either dialect: ``chunk(choices, **extra)`` renders one chunk,
    ``delta(text, logprobs)`` is choice 0's streamed text with its tokens' logprobs entries (none unless asked
    for), ``final(index, rest, choice, logprobs)`` a choice's finishing piece (``rest`` and ``logprobs``: its
    text and entries not yet streamed)."""
    pieces: list[str] = []
    sent = 0  # choice 0's logprobs entries streamed
    text_frame = spliced(lambda text: chunk([delta(text, [])]))  # a token without logprobs entries
    try:
        async for ev in _events(first, events):
            if ev.kind == "text" and ev.text:
                pieces.append(ev.text)
                if ev.logprobs:
                    sent += len(ev.logprobs)
                    yield chunk([delta(ev.text, ev.logprobs)])
                else:
                    yield text_frame(ev.text)
            elif ev.kind == "result":
                result = ev.result or {}
                streamed = "".join(pieces)
                for i, c in enumerate(choices_of(result)):
                    text = c.get("text", "")
                    rest = (text[len(streamed) :] if text.startswith(streamed) else "") if i == 0 else text
                    yield chunk([final(i, rest, c, entries(c)[sent:] if i == 0 else entries(c))])
                if include_usage:
                    yield chunk([], usage=usage(result, job.prompt_tokens), speculation=speculation(result))
    except APIError as e:
        yield sse(e.body())
    yield "data: [DONE]\n\n"


async def completion_stream(
    rid: str,
    model: str,
    req: CompletionRequest,
    tok: Tokenizer,
    job: Job,
    first: Any,
    events: AsyncIterator[Any],
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], **extra: Any) -> str:
        return sse(CompletionChunk(id=rid, created=created, model=model, choices=choices, **extra))

    offset = 0  # choice 0's text offset of the next streamed token

    def logprobs(chosen: list[dict]) -> CompletionLogprobs | None:
        nonlocal offset
        lp = completion_logprobs(tok, chosen, offset)
        offset += sum(len(t) for t in lp.tokens) if lp is not None else 0
        return lp

    def delta(text: str, chosen: list[dict]) -> CompletionChoice:
        return CompletionChoice(index=0, text=text, logprobs=logprobs(chosen))

    def final(i: int, rest: str, c: dict, chosen: list[dict]) -> CompletionChoice:
        text = (job.echo or "") + rest if i > 0 else rest  # choice 0's echo went first
        lp = logprobs(chosen) if i == 0 else completion_logprobs(tok, chosen)
        return CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=finish(c))

    if job.echo:
        yield chunk([CompletionChoice(index=0, text=job.echo)])
    async for line in _stream(chunk, delta, final, req.include_usage(), job, first, events):
        yield line


def chat_chunks(rid: str, model: str) -> Callable[..., str]:
    """The SSE frame of a chat chunk of response ``rid`` (its id, model and creation time fixed once)."""
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], **extra: Any) -> str:
        return sse(ChatChunk(id=rid, created=created, model=model, choices=choices, **extra))

    return chunk


async def chat_stream(
    rid: str,
    model: str,
    req: ChatRequest,
    tok: Tokenizer,
    job: Job,
    first: Any,
    events: AsyncIterator[Any],
) -> AsyncIterator[str]:
    chunk = chat_chunks(rid, model)

    def delta(text: str, chosen: list[dict]) -> ChatChunkChoice:
        return ChatChunkChoice(index=0, delta=ChatDelta(content=text), logprobs=chat_logprobs(tok, chosen))

    def final(i: int, rest: str, c: dict, chosen: list[dict]) -> ChatChunkChoice:
        lp = chat_logprobs(tok, chosen)
        return ChatChunkChoice(index=i, delta=ChatDelta(content=rest or None), logprobs=lp, finish_reason=finish(c))

    for i in range(job.n):  # each choice's role first
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    async for line in _stream(chunk, delta, final, req.include_usage(), job, first, events):
        yield line


async def prime(events: AsyncIterator[Any]) -> Any:
    """The run's first event, awaited before the response starts: a run refused or failed before its first
    token gets its own status code, not a 200 stream carrying an error."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None


DROP = "pie.drop_connection"  # the scope's key for dropping its connection (:class:`Droppable`)


class Droppable:
    """The server's outermost ASGI app: puts in each HTTP scope a callable (``scope[DROP]``) that drops the
    request's connection at once, by aborting the server's transport.

    For a stream that cannot end cleanly: its client stopped reading, so neither its last chunk nor the final
    empty one can be written (the server waits for the socket to drain before each send). Returning without
    that final message makes uvicorn log "ASGI callable returned without completing response" as an error and
    ``close()`` the transport, which keeps the socket until its unread bytes are taken: never, for a client
    that does not read. ASGI has no message for an abort, so this reaches uvicorn's transport through the
    ``send`` it hands the outermost app (its request cycle's bound method); where that is not there (another
    server, a test client) the scope has no ``DROP`` and a stall ends as before."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if scope["type"] == "http" and callable(getattr(transport, "abort", None)):
            scope = {**scope, DROP: transport.abort}  # type: ignore[union-attr]
        await self.app(scope, receive, send)


class StallGuardedStream(StreamingResponse):
    """A streaming response that ends when its client stops reading: a chunk the connection would not take
    within ``stall_s`` seconds (the socket's buffers full) closes the chunk iterator, which cancels the run and
    frees its slot and pages, and the connection is dropped (:class:`Droppable`): the response ends there,
    with nothing more written and nothing logged but the warning."""

    def __init__(self, content: AsyncIterator[str], stall_s: float | None, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.stall_s = stall_s
        self.stalled = False
        self._drop: Callable[[], None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._drop = scope.get(DROP)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        async def guarded(message: Message) -> None:
            # asyncio.timeout, not wait_for: wait_for wraps each send in a task of its own (Python 3.11),
            # an extra task and loop turn for every streamed token
            try:
                async with asyncio.timeout(self.stall_s):
                    await send(message)
            except TimeoutError:
                self.stalled = True
                raise

        try:
            await super().stream_response(guarded)
        except TimeoutError:
            if not self.stalled:
                raise
            log.warning("a streaming client read nothing for %.0f s: its run is cancelled", self.stall_s)
        finally:
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                await closer()  # the run's events end here: it is cancelled in its host, its lease released
        if self.stalled and self._drop is not None:
            self._drop()
            # the transport tells the server the connection is lost on the loop's next turn: let it, so that the
            # server sees a client gone, not a response left unfinished
            await asyncio.sleep(0)


def sse_response(
    chunks: AsyncIterator[str], headers: dict[str, str] | None = None, stall_s: float | None = None
) -> StreamingResponse:
    """An SSE response; ``stall_s``: a client that reads nothing for that long loses its run."""
    return StallGuardedStream(
        chunks, stall_s, media_type="text/event-stream", headers={"cache-control": "no-cache", **(headers or {})}
    )
