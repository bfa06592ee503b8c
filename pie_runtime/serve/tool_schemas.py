"""The OpenAI wire schemas of tool calling (``tools``, ``tool_choice``, ``tool_calls`` in messages, responses and
stream deltas), below openai_api.py, which puts them into its request and response objects. Function names follow
OpenAI's rule (letters, digits, ``_`` and ``-``, at most 64): a name is written into the tool-call grammar as it
is, so nothing else may pass."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDef(_Wire):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; none: no arguments
    strict: bool | None = None


class Tool(_Wire):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Wire):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Wire):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed piece of a tool call: the first carries ``id``, ``type`` and ``function.name``, the rest
    ``function.arguments`` chunks; ``index`` says which call of the message it belongs to."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta
