"""The Responses API's wire (``POST /v1/responses``): the request, its translation to a chat request (the one
path that renders the template, checks limits and holds tool calls to their grammar: tools.py), and the
``response`` object and its output items built from a run's parsed output.

    input: "text"                              → one user message
    input: [items]                             → messages: {"role", "content": text or [input_text parts]},
                                                 {"type": "function_call", "call_id", "name", "arguments"} (an
                                                 assistant's call), {"type": "function_call_output", "call_id",
                                                 "output"} (a tool result)
    instructions                               → a system message first (not carried to a later response)
    tools: [{"type": "function", "name", ...}] → chat tools; tool_choice likewise ({"type": "function", "name"})
    max_output_tokens, temperature, top_p      → max_completion_tokens, temperature, top_p

Output: a ``message`` item with one ``output_text`` part, or ``function_call`` items (one per call).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inferlet.text.tool_calls import ToolCallParser

from .errors import invalid_request
from .openai_api import ChatMessage, ChatRequest, SpeculationRequest, TextPart, Usage
from .tool_schemas import FUNCTION_NAME, FunctionCall, FunctionDef, NamedFunction, NamedToolChoice, Tool, ToolCall


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionTool(_Wire):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Wire):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class ResponsesRequest(_Wire):
    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    user: str | None = None
    metadata: dict[str, str] | None = None
    speculation: Literal[False] | SpeculationRequest | None = None  # pie's extension, as on chat

    def chat_tools(self) -> list[Tool] | None:
        if not self.tools:
            return None
        return [
            Tool(function=FunctionDef(name=t.name, description=t.description, parameters=t.parameters))
            for t in self.tools
        ]

    def chat_tool_choice(self) -> Any:
        c = self.tool_choice
        return NamedToolChoice(function=NamedFunction(name=c.name)) if isinstance(c, FunctionChoice) else c


def input_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The request's input as chat messages (module docstring); a 400 naming the item that cannot be read."""
    if isinstance(req.input, str):
        return [ChatMessage(role="user", content=req.input)]
    out: list[ChatMessage] = []
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            role, content = item.get("role"), item.get("content")
            if role not in ("user", "system", "developer", "assistant") or content is None:
                raise invalid_request("a message item needs a role and content", param=f"input[{i}]")
            out.append(ChatMessage(role=role, content=_text(content, i)))
        elif kind == "function_call":
            call = ToolCall(
                id=str(item.get("call_id") or ""),
                function=FunctionCall(name=str(item.get("name") or ""), arguments=str(item.get("arguments") or "{}")),
            )
            if out and out[-1].role == "assistant" and out[-1].tool_calls:  # parallel calls: one assistant turn
                out[-1].tool_calls.append(call)
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output or [], i)
            out.append(ChatMessage(role="tool", content=text, tool_call_id=str(item.get("call_id") or "")))
        else:
            raise invalid_request(f"input items of type {kind!r} are not supported", param=f"input[{i}].type")
    return out


def _text(content: Any, i: int) -> str:
    """A message's content: a string, or its text parts joined (input_text, output_text, text)."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise invalid_request("only text content parts are supported", param=f"input[{i}].content")
        parts.append(TextPart(type="text", text=str(part.get("text", ""))))
    return "".join(p.text for p in parts)


def chat_request(req: ResponsesRequest, history: list[ChatMessage]) -> ChatRequest:
    """The chat request that runs ``req`` after the conversation ``history`` (a previous response's)."""
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    return ChatRequest(
        model=req.model,
        messages=[*system, *history, *input_messages(req)],
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stream=req.stream,
        tools=req.chat_tools(),
        tool_choice=req.chat_tool_choice(),
        parallel_tool_calls=req.parallel_tool_calls,
        user=req.user,
        speculation=req.speculation,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(parser: ToolCallParser) -> list[dict[str, Any]]:
    """A whole output's items: its complete calls, or its text."""
    calls = [c for c in parser.calls if c.complete]
    if calls:
        return [call_item(new_id("fc"), new_id("call"), c.name, c.arguments) for c in calls]
    return [message_item(new_id("msg"), parser.content)]


def _choice(req: ResponsesRequest) -> Any:
    c = req.tool_choice
    return c.model_dump() if isinstance(c, BaseModel) else c or "auto"


def response_object(
    rid: str,
    req: ResponsesRequest,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None = None,
    incomplete: bool = False,
) -> dict[str, Any]:
    """The ``response`` object (what the route returns, and what the stream's created / completed events carry)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": req.tool_choice.model_dump()
        if isinstance(req.tool_choice, BaseModel)
        else req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "metadata": req.metadata or {},
        "text": {"format": {"type": "text"}},
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
    }
    if usage is not None:
        body["usage"] = {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        }
    return body
