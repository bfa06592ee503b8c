"""The OpenAI wire schemas of `pie serve`: request bodies (validated by pydantic: a wrong type or range is a
400 ``invalid_request_error`` naming the field) and the response and stream-chunk objects.

Fields beyond OpenAI's are vLLM's (``top_k``, ``stop_token_ids``, ``ignore_eos``) and pie's own extensions
``speculation``: ``false`` turns speculation off for the request, ``{"method": "lookup" | "draft" | "mtp" |
"suffix", "k": K}`` asks for it (responses under speculation carry a ``speculation`` object); and
``prompt_cache``: the name of a saved prompt cache to start from (prompt_caches.py); and ``inferlet``: a custom
inferlet to run instead of the shipped ones (custom_models.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from .engine_life import EngineStatus
from .tool_schemas import Tool, ToolCall, ToolCallDelta, ToolChoice

TOKEN_ID_MAX = 2**31 - 1  # a bound on token ids and counts in requests (no vocabulary is larger)
TokenKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]  # a token id as a JSON object key


class _Wire(BaseModel):
    # unknown fields are ignored, as OpenAI-compatible servers do (clients send vendor extras)
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Wire):
    include_usage: bool = False


class SpeculationRequest(_Wire):
    method: Literal["lookup", "draft", "mtp", "suffix"]
    k: int = Field(ge=1, le=64)


class JsonSchemaFormat(_Wire):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Wire):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=TOKEN_ID_MAX)  # vLLM: -1 or 0 is no top-k
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[TokenKey, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    speculation: Literal[False] | SpeculationRequest | None = None
    return_token_ids: bool = False  # vLLM's extension: each choice's token ids
    inferlet: str | None = Field(
        default=None,
        max_length=64,
        description=(
            "pie's extension: run this custom inferlet (pie serve --inferlets DIR) instead of the shipped ones, as "
            "the model MODEL:NAME does; it must take the completion arguments (custom_models.py)"
        ),
    )
    prompt_cache: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$",
        description=(
            "pie's extension: start from the saved prompt cache of this name (POST /v1/prompt_caches; the server "
            "needs --prompt-cache-dir). The prompt is still the whole prompt: the run keeps the cached rows it "
            "starts with and computes the rest (usage.prompt_tokens_details.cached_tokens says how many came from "
            "the cache). A name, never a path; a cache of another model or format is a 400 kv_mismatch."
        ),
    )

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("at most 16 non-empty stop strings")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(
        cls, v: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)) and len(v) != 1:
            raise ValueError("one prompt per request (send a list of prompts as separate requests)")
        if isinstance(v, list) and (not v or (isinstance(v[0], list) and not v[0])):
            raise ValueError("the prompt is empty")
        return v


class TextPart(_Wire):
    type: Literal["text"]
    text: str


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (tools.py renders them back)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=128)  # tools.py: prompt, grammar, parsing
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool = True


# ---- responses ----------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class Speculation(BaseModel):
    """A run's speculation counters (the inferlet's ``speculation`` result, as it reports it)."""

    model_config = ConfigDict(extra="allow")
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    acceptance: float = 0.0
    per_position: list[Any] = []
    skipped: dict[str, int] = {}


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = None


class _Envelope(BaseModel):
    """What every completion and chat response, whole or a streamed chunk, carries beside its choices."""

    id: str
    created: int
    model: str
    usage: Usage | None = None
    speculation: Speculation | None = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = []


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    token_ids: list[int] | None = None


class ChatResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChunk(CompletionResponse):
    """A streamed piece of a completion: OpenAI gives it the whole response's shape."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pie"
    max_model_len: int
    parent: str | None = None  # a custom inferlet's MODEL:NAME: the model it runs on (as vLLM's LoRA cards)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every refused or failed request's body, in OpenAI's shape (errors.py)."""

    error: ErrorDetail


# ---- pie's own routes -----------------------------------------------------------------------------------------


class Health(BaseModel):
    status: Literal["starting", "ready", "restarting", "draining", "failed"]
    error: str | None = None
    engine: EngineStatus | None = None  # the engine's state, pid, restarts and last exit (engine_life.py)


class TokenizeRequest(_Wire):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Wire):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class RunRequest(_Wire):
    """``POST /v1/inferlets/{name}/runs``: the inferlet's arguments (validated by its own Args model)."""

    args: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False


class RunResponse(BaseModel):
    id: str
    object: Literal["inferlet.run"] = "inferlet.run"
    inferlet: str
    result: Any = None


class RunCancelled(BaseModel):
    id: str
    object: Literal["inferlet.run"] = "inferlet.run"
    cancelled: bool


class SavePromptCache(_Wire):
    """``POST /v1/prompt_caches``: prefill a prompt (or chat messages, rendered with the model's template) and
    save its KV under ``name``, replacing a cache of that name."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$", description="a name, never a path")
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False  # a cached prefix is usually the conversation so far, not a turn


class PromptCacheCard(BaseModel):
    id: str
    object: Literal["prompt_cache"] = "prompt_cache"
    created: int
    bytes: int
    rows: int  # the saved rows (the prompt's tokens but its last, which a load computes)
    model: str | None = None
    weights: str | None = None
    kv_dtype: str | None = None


class PromptCacheList(BaseModel):
    object: Literal["list"] = "list"
    data: list[PromptCacheCard]


class PromptCacheDeleted(BaseModel):
    id: str
    object: Literal["prompt_cache"] = "prompt_cache"
    deleted: bool


class InferletCard(BaseModel):
    id: str
    object: Literal["inferlet"] = "inferlet"
    source: Literal["shipped", "custom", "uploaded"]


class InferletList(BaseModel):
    object: Literal["list"] = "list"
    data: list[InferletCard]


def sse_or(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route that answers ``model`` as JSON, or server-sent events with
    ``stream: true``."""
    event = {  # one server-sent event, as SSE clients (and schemathesis) read the stream: a chunk, [DONE] last
        "type": "object",
        "description": "data: a JSON chunk of the response, then data: [DONE]",
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
        "required": ["data"],
    }
    events = {"schema": event}
    return {200: {"model": model, "content": {"text/event-stream": events}}}
