"""Tool calling on /v1/chat/completions: the request's tools checked, the prompt that shows them to the model,
and the grammar its calls are generated under (inferlet.text.tool_calls: the Hermes format, every call's arguments
held to its function's JSON schema by llguidance).

    tool_choice      grammar                          what the model may write
    "none"           none (tools are not shown)       text
    "auto"           TEXT | calls                     free text, or whole calls (never half a call)
    "required"       calls                            one call (or several with parallel_tool_calls)
    {"function": f}  f's call only                    exactly one call of f

The prompt: a chat template that reads ``tools`` (a Hugging Face template with a tools branch) renders them
itself, and an assistant's earlier calls (``tool_calls``) and tool results (role ``tool``) go to it as
messages carrying those fields. A template without one (the default model's) gets the default system block
below (Qwen2.5's wording), the earlier calls as call blocks in the assistant's text, and each run of tool
results as one user turn of ``<tool_response>`` blocks, as Hermes-format templates write them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from inferlet.text.tool_calls import Mode, render_call, tool_call_grammar
from inferlet.tokenizer import Tokenizer

from .errors import invalid_request
from .openai_api import ChatMessage, ChatRequest
from .tool_schemas import NamedToolChoice, Tool

SYSTEM_BLOCK = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass
class ToolPlan:
    """What a chat request's tools make of its run: the tools shown in the prompt, and the grammar of its
    output (None: plain text, nothing parsed)."""

    tools: list[Tool] = field(default_factory=list)
    grammar: str | None = None

    @property
    def calls(self) -> bool:
        """Whether the output may hold calls (and is parsed for them)."""
        return self.grammar is not None

    def prompt(self, tok: Tokenizer, req: ChatRequest) -> str:
        """The request's messages (and tools) rendered with the model's chat template."""
        wire = [t.model_dump(exclude_none=True) for t in self.tools]
        try:
            if tok.takes_tools:
                return tok.chat([_template_message(m) for m in req.messages], tools=wire or None)
            return tok.chat(_plain_messages(req.messages, wire))
        except ValueError as e:  # no chat template
            raise invalid_request(str(e), param="messages") from e


def plan_tools(req: ChatRequest) -> ToolPlan:
    """The request's tool plan, or a 400 naming the field that cannot be served."""
    tools = req.tools or []
    choice = req.tool_choice or ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan()
    if not tools:
        raise invalid_request("tool_choice needs tools", param="tool_choice")
    functions: dict[str, dict[str, Any] | None] = {}
    for i, t in enumerate(tools):
        if t.function.name in functions:
            raise invalid_request(f"two tools are named {t.function.name!r}", param=f"tools[{i}].function.name")
        functions[t.function.name] = _checked_parameters(t.function.parameters, i)
    if req.response_format is not None and req.response_format.type != "text":
        raise invalid_request("response_format with tools is not supported", param="response_format")
    if req.logprobs:
        raise invalid_request("logprobs with tools is not supported", param="logprobs")
    mode: Mode = "auto" if choice == "auto" else "required"
    parallel = req.parallel_tool_calls
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in functions:
            raise invalid_request(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        functions, parallel = {name: functions[name]}, False
    grammar = tool_call_grammar(functions, mode, parallel)
    _check_grammar(grammar)
    return ToolPlan(tools=tools, grammar=grammar)


def _checked_parameters(params: dict[str, Any] | None, i: int) -> dict[str, Any] | None:
    """A function's parameters: a valid JSON schema of an object (OpenAI's rule), else a 400."""
    if params is None:
        return None
    param = f"tools[{i}].function.parameters"
    if params.get("type", "object") != "object":
        raise invalid_request("a function's parameters must be a JSON schema of type object", param=param)
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    try:
        validator_for(params).check_schema(params)
    except SchemaError as e:
        raise invalid_request(f"invalid JSON schema: {e.message}", param=param) from e
    return params


def _check_grammar(grammar: str) -> None:
    """A 400 for schemas llguidance cannot compile (checked here, before a run starts)."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise invalid_request(f"the tools' schemas cannot be held to: {error}", param="tools")


def _arguments(text: str) -> Any:
    """A call's arguments as a template wants them: the object, or the text when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message for a template that takes tools: calls and results as Hugging Face templates read them."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
        if m.name:
            out["name"] = m.name
    return out


def _plain_messages(messages: list[ChatMessage], tools: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages for a template without a tools branch (module docstring): the tools in a system block, calls
    in the assistant's text, each run of tool results one user turn."""
    out: list[dict[str, str]] = []
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": "1"})
            continue
        text = m.text()
        if m.tool_calls:
            calls = "\n".join(render_call(c.function.name, c.function.arguments) for c in m.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        out.append({"role": m.role, "content": text})
    if tools:
        block = SYSTEM_BLOCK.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return [{"role": m["role"], "content": m["content"]} for m in out]
