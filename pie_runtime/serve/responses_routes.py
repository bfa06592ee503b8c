"""``POST /v1/responses``: the Responses API over the chat path (responses_api.py translates the request; the
run, its admission and its tool grammar are chat's), answered whole or as typed server-sent events:

    response.created, response.in_progress
    a text output:  response.output_item.added (message), response.content_part.added,
                    response.output_text.delta ..., response.output_text.done, response.content_part.done,
                    response.output_item.done
    each call:      response.output_item.added (function_call), response.function_call_arguments.delta ...,
                    response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut the output); a failure: error

``previous_response_id`` continues a stored response's conversation (its input and output, not its
instructions): the server keeps the last responses of each API key (``store: false`` keeps none), and the
engine's prefix cache serves the rows of the conversation it still holds, so the earlier turns are not computed
again.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, ValidationError

from inferlet.text.tool_calls import CallArguments, CallStart, Content, Event, ToolCallParser, parse_tool_calls
from inferlet.tokenizer import Tokenizer

from .errors import APIError, invalid_request, not_found
from .generation import Job, choices_of, usage
from .openai_api import ChatMessage, ChatRequest, Usage, sse_or
from .responses_api import (
    ResponsesRequest,
    call_item,
    chat_request,
    message_item,
    new_id,
    output_items,
    response_object,
)
from .tool_schemas import FunctionCall, ToolCall
from .tools import plan_tools

KEPT_PER_KEY = 256  # stored responses per API key (the oldest go first)
Generate = Callable[..., Awaitable[Response]]


class ResponseBody(BaseModel):
    """A whole ``response`` object (responses_api.response_object's fields)."""

    model_config = ConfigDict(extra="allow")


class Conversations:
    """Each API key's last responses: id → the conversation through that response's output."""

    def __init__(self) -> None:
        self._by_key: dict[str, OrderedDict[str, list[ChatMessage]]] = {}

    def get(self, key: str, rid: str) -> list[ChatMessage]:
        kept = self._by_key.get(key, OrderedDict()).get(rid)
        if kept is None:
            raise not_found(f"no stored response {rid!r}", "previous_response_not_found", "previous_response_id")
        return list(kept)

    def put(self, key: str, rid: str, messages: list[ChatMessage]) -> None:
        kept = self._by_key.setdefault(key, OrderedDict())
        kept[rid] = messages
        while len(kept) > KEPT_PER_KEY:
            kept.popitem(last=False)


def as_messages(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """A response's output items as the assistant turn that continues the conversation."""
    calls = [
        ToolCall(id=i["call_id"], function=FunctionCall(name=i["name"], arguments=i["arguments"]))
        for i in items
        if i["type"] == "function_call"
    ]
    if calls:
        return [ChatMessage(role="assistant", content=None, tool_calls=calls)]
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    return [ChatMessage(role="assistant", content=text)]


class EventStream:
    """The typed events of one streamed response (module docstring), from the parser's events."""

    def __init__(self, rid: str, req: ResponsesRequest, model: str) -> None:
        self.rid, self.req, self.model = rid, req, model
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.item: dict[str, Any] | None = None  # the open item

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def start(self) -> list[str]:
        body = response_object(self.rid, self.req, self.model, "in_progress", [])
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def _where(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def on(self, e: Event) -> list[str]:
        out: list[str] = []
        if isinstance(e, Content):
            if self.item is None or self.item["type"] != "message":
                out += self.close()
                self.item = message_item(new_id("msg"), "", "in_progress")
                part = self.item["content"].pop()
                out.append(self.event("response.output_item.added", output_index=len(self.output), item=self.item))
                out.append(self.event("response.content_part.added", content_index=0, part=part, **self._where()))
                self.item["content"].append(part)
            self.item["content"][0]["text"] += e.text
            out.append(
                self.event("response.output_text.delta", content_index=0, delta=e.text, logprobs=[], **self._where())
            )
        elif isinstance(e, CallStart):
            out += self.close()
            self.item = call_item(new_id("fc"), new_id("call"), e.name, "", "in_progress")
            out.append(self.event("response.output_item.added", output_index=len(self.output), item=self.item))
        elif isinstance(e, CallArguments) and self.item is not None:
            self.item["arguments"] += e.text
            out.append(self.event("response.function_call_arguments.delta", delta=e.text, **self._where()))
        return out

    def close(self, complete: bool = True) -> list[str]:
        """The events that finish the open item (a call cut off before its end is ``incomplete``)."""
        item, out = self.item, []
        if item is None:
            return out
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self.event("response.output_text.done", content_index=0, text=part["text"], logprobs=[], **where)
            )
            out.append(self.event("response.content_part.done", content_index=0, part=part, **where))
        else:
            out.append(self.event("response.function_call_arguments.done", arguments=item["arguments"], **where))
        item["status"] = "completed" if complete else "incomplete"
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.output.append(item)
        self.item = None
        return out

    def end(self, parser: ToolCallParser, length: bool, used: Usage) -> list[str]:
        cut_call = bool(parser.calls) and not parser.calls[-1].complete
        out = self.close(complete=not cut_call)
        if not self.output:  # nothing was written: an empty message
            out += self.on(Content("")) + self.close()
        status = "incomplete" if length else "completed"
        body = response_object(self.rid, self.req, self.model, status, self.output, used, incomplete=length)
        return out + [self.event(f"response.{status}", response=body)]


def add_responses_routes(v1: APIRouter, api_key: Callable[..., str], generate: Generate) -> None:
    """``POST /v1/responses``, run through chat's ``generate`` (app.py)."""
    conversations = Conversations()

    @v1.post("/responses", response_model=None, responses=sse_or(ResponseBody))
    async def responses(
        request: Request,
        req: ResponsesRequest,
        key: str = Depends(api_key),
        x_session_id: str | None = Header(default=None),
    ) -> Response:
        history = conversations.get(key, req.previous_response_id) if req.previous_response_id else []
        try:
            chat = chat_request(req, history)
        except ValidationError as e:
            raise invalid_request(f"the input cannot be read: {e.errors()[0]['msg']}", param="input") from None
        plan = plan_tools(chat)
        said = chat.messages[1:] if req.instructions else chat.messages  # instructions are not carried on

        def remember(rid: str, items: list[dict[str, Any]]) -> None:
            if req.store:
                conversations.put(key, rid, [*said, *as_messages(items)])

        def respond(rid: str, model: str, tok: Tokenizer, job: Job, result: dict, token_ids: bool = False) -> BaseModel:
            choice = choices_of(result)[0]
            items = output_items(parse_tool_calls(choice.get("text", ""), text_only=not plan.calls))
            remember(rid, items)
            length = choice.get("finish_reason") != "stop"
            used = usage(result, job.prompt_tokens)
            return ResponseBody(
                **response_object(rid, req, model, "incomplete" if length else "completed", items, used, length)
            )

        async def stream(
            rid: str, model: str, _: ChatRequest, tok: Tokenizer, job: Job, first: Any, events: AsyncIterator[Any]
        ) -> AsyncIterator[str]:
            out = EventStream(rid, req, model)
            parser, sent = ToolCallParser(text_only=not plan.calls), []
            for line in out.start():
                yield line
            try:
                async for ev in _with_first(first, events):
                    if ev.kind == "text" and ev.text:
                        sent.append(ev.text)
                        for e in parser.feed(ev.text):
                            for line in out.on(e):
                                yield line
                    elif ev.kind == "result":
                        result = ev.result or {}
                        choice = choices_of(result)[0]
                        text, streamed = choice.get("text", ""), "".join(sent)
                        rest = text[len(streamed) :] if text.startswith(streamed) else ""
                        for e in parser.feed(rest) + parser.finish():
                            for line in out.on(e):
                                yield line
                        length = choice.get("finish_reason") != "stop"
                        for line in out.end(parser, length, usage(result, job.prompt_tokens)):
                            yield line
                        remember(rid, out.output)
            except APIError as e:
                yield out.event("error", code=e.code, message=e.message, param=e.param)

        return await generate(request, chat, key, plan.prompt, "resp", stream, respond, x_session_id, plan.grammar)


async def _with_first(first: Any, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for ev in events:
        yield ev
