"""Chat responses whose output may hold tool calls (tools.py): the calls read out of the run's text
(inferlet.text.tool_calls' parser) into ``message.tool_calls``, whole or streamed as OpenAI's deltas:

    {"delta": {"role": "assistant", "content": ""}}                               each choice's role first
    {"delta": {"tool_calls": [{"index": 0, "id": "call_..", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}}   a call begins
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\""}}]}}   its arguments, in pieces
    {"delta": {}, "finish_reason": "tool_calls"}

Text that is not a call streams as ``content`` deltas. ``finish_reason`` is "tool_calls" when a choice
stopped after whole calls; a call cut off by ``max_tokens`` is left out of the whole response
(``finish_reason`` "length"). Only choice 0 streams; with ``n > 1`` the others come whole when the run ends.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from inferlet.text.tool_calls import CallArguments, CallStart, Content, Event, ToolCallParser, parse_tool_calls
from inferlet.tokenizer import Tokenizer

from .errors import APIError
from .generation import Job, choices_of, finish, speculation, usage
from .openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatDelta,
    ChatRequest,
    ChatResponse,
)
from .streams import chat_chunks, sse
from .tool_schemas import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(choice: dict[str, Any], parser: ToolCallParser) -> Literal["stop", "length", "tool_calls"]:
    reason = finish(choice)
    return "tool_calls" if reason == "stop" and parser.has_calls else reason


def message_of(parser: ToolCallParser) -> AssistantMessage:
    """The assistant message of a parsed output: its whole calls, or its text."""
    calls = [
        ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in parser.calls
        if c.complete
    ]
    return AssistantMessage(content=parser.content or (None if parser.calls else ""), tool_calls=calls or None)


def tool_chat_response(
    rid: str, model: str, tok: Tokenizer, job: Job, result: dict, token_ids: bool = False
) -> ChatResponse:
    choices = []
    for i, c in enumerate(choices_of(result)):
        parser = parse_tool_calls(c.get("text", ""))
        ids = [int(t) for t in c.get("token_ids") or []] if token_ids else None
        choices.append(
            ChatChoice(index=i, message=message_of(parser), finish_reason=finish_reason(c, parser), token_ids=ids)
        )
    return ChatResponse(
        id=rid,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=usage(result, job.prompt_tokens),
        speculation=speculation(result),
    )


class _Deltas:
    """Parser events → chat deltas of one choice (each call's id given when it begins)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def of(self, e: Event) -> ChatChunkChoice:
        if isinstance(e, Content):
            delta = ChatDelta(content=e.text)
        elif isinstance(e, CallStart):
            fn = FunctionCallDelta(name=e.name, arguments="")
            delta = ChatDelta(tool_calls=[ToolCallDelta(index=e.index, id=call_id(), type="function", function=fn)])
        else:
            assert isinstance(e, CallArguments)
            delta = ChatDelta(tool_calls=[ToolCallDelta(index=e.index, function=FunctionCallDelta(arguments=e.text))])
        return ChatChunkChoice(index=self.index, delta=delta)


async def tool_chat_stream(
    rid: str,
    model: str,
    req: ChatRequest,
    tok: Tokenizer,
    job: Job,
    first: Any,
    events: AsyncIterator[Any],
) -> AsyncIterator[str]:
    chunk = chat_chunks(rid, model)

    for i in range(job.n):
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    parser, deltas, streamed = ToolCallParser(), _Deltas(0), []
    try:
        async for ev in _with_first(first, events):
            if ev.kind == "text" and ev.text:
                streamed.append(ev.text)
                for e in parser.feed(ev.text):
                    yield chunk([deltas.of(e)])
            elif ev.kind == "result":
                result = ev.result or {}
                for i, c in enumerate(choices_of(result)):
                    if i == 0:
                        text, sent = c.get("text", ""), "".join(streamed)
                        p, d = parser, deltas
                        pending = p.feed(text[len(sent) :] if text.startswith(sent) else "") + p.finish()
                    else:
                        p, d = ToolCallParser(), _Deltas(i)
                        pending = p.feed(c.get("text", "")) + p.finish()
                    for e in pending:
                        yield chunk([d.of(e)])
                    yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(), finish_reason=finish_reason(c, p))])
                if req.include_usage():
                    yield chunk([], usage=usage(result, job.prompt_tokens), speculation=speculation(result))
    except APIError as e:
        yield sse(e.body())
    yield "data: [DONE]\n\n"


async def _with_first(first: Any, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for ev in events:
        yield ev
