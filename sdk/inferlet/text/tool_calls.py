"""Tool calls as text: the format a model writes them in, the llguidance grammar that holds it to the
functions' JSON schemas, and a parser that reads calls out of the text as it streams.

The format is Hermes' (what Qwen2.5/3, Hermes 2/3 and SmolLM3 chat templates ask for), one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

parallel calls separated by a newline. The grammar (Lark, with llguidance's ``%json`` for each function's
arguments) writes the call's frame and the function's name as literals, so under it every call names a
given function and its arguments validate against that function's schema:

    start: calls                          # "required" or a named function (only that function's call)
    start: TEXT | calls                   # "auto": free text that never holds "<tool_call>", or calls
    calls: call | call ("\\n" call)*      # one call, or parallel calls
    call:  call_0 | call_1 | ...          # call_i: the frame with function i's name, then args_i, then the end
    args_i: %json {function i's parameters schema}

JSON inside a call is written with fixed separators (``", "``, ``": "``) and no other whitespace, so a small
model cannot wander into blank space.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

OPEN = "<tool_call>\n"
CLOSE = "\n</tool_call>"
SEP = "\n"  # between parallel calls
_HEAD = '{"name": "'
_MID = '", "arguments": '
_END = "}" + CLOSE
# llguidance's JSON options for arguments: no free whitespace, the separators json.dumps writes by default
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# free text in "auto": anything that does not hold the opening tag (a call is a call, never text)
TEXT_RULE = r"TEXT: /(.|\n)+/ & ~/(.|\n)*<tool_call>(.|\n)*/"
EMPTY_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without parameters

Mode = Literal["auto", "required"]


def render_call(name: str, arguments: Any) -> str:
    """One call block as the model writes it (an assistant's earlier call, fed back into a prompt)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"{OPEN}{_HEAD}{name}{_MID}{args}{_END}"


def arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's arguments schema as the grammar takes it: an object schema (none: no arguments) with the
    JSON style above (the schema's own ``x-guidance`` options kept where they do not set it)."""
    schema = dict(parameters) if parameters else dict(EMPTY_ARGS)
    schema.setdefault("type", "object")
    schema["x-guidance"] = {**(schema.get("x-guidance") or {}), **JSON_STYLE}
    return schema


def tool_call_grammar(functions: Mapping[str, dict[str, Any] | None], mode: Mode, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of the module docstring for ``functions`` (name → parameters
    schema, in order); ``mode`` "auto" adds the free-text branch; ``parallel`` allows several calls."""
    if not functions:
        raise ValueError("no functions to call")
    lines = ["%llguidance {}", "start: TEXT | calls" if mode == "auto" else "start: calls"]
    lines.append('calls: call ("\\n" call)*' if parallel else "calls: call")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    for i, (name, params) in enumerate(functions.items()):
        head = json.dumps(OPEN + _HEAD + name + _MID)  # a Lark string literal is a JSON string here
        lines.append(f"call_{i}: {head} args_{i} {json.dumps(_END)}")
        lines.append(f"args_{i}: %json {json.dumps(arguments_schema(params))}")
    if mode == "auto":
        lines.append(TEXT_RULE)
    return "\n".join(lines) + "\n"


@dataclass
class Content:
    """Text that is not a call."""

    text: str


@dataclass
class CallStart:
    """Call ``index`` began; its function's name is complete."""

    index: int
    name: str


@dataclass
class CallArguments:
    """More of call ``index``'s arguments text."""

    index: int
    text: str


Event = Content | CallStart | CallArguments


@dataclass
class ParsedCall:
    name: str
    arguments: str
    complete: bool = False


@dataclass
class ToolCallParser:
    """Reads calls out of a model's text as it grows (``feed``), for text written in the format above (as the
    grammar holds it): the text is either all content, or calls only. ``feed`` returns what the new text
    completes; ``finish`` what is left at the end. Text that leaves the format is content from there on;
    ``text_only``: all of it is content (an output generated without tools)."""

    text_only: bool = False
    calls: list[ParsedCall] = field(default_factory=list)
    content: str = ""
    _buf: str = ""
    _pos: int = 0
    _state: str = "start"  # start | text | head | name | mid | args | tail | sep | broken
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False

    def __post_init__(self) -> None:
        if self.text_only:
            self._state = "text"

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        """The events of text held back at the end (a partial opening tag is content after all)."""
        if self._state == "start" and self._buf:
            return self._to_content(self._buf)
        return []

    @property
    def has_calls(self) -> bool:
        return any(c.complete for c in self.calls)

    def _to_content(self, text: str) -> list[Event]:
        self._state, self._pos = ("text" if self._state == "start" else "broken"), len(self._buf)
        self.content += text
        return [Content(text)] if text else []

    def _literal(self, lit: str) -> bool | None:
        """Whether the text at the cursor is ``lit`` (the cursor moves past it); None while it may still be."""
        have = self._buf[self._pos : self._pos + len(lit)]
        if have == lit:
            self._pos += len(lit)
            return True
        return None if lit.startswith(have) else False

    def _step(self, out: list[Event]) -> bool:
        """Advances by one piece of the format; False when it needs more text."""
        st = self._state
        if st in ("text", "broken"):
            rest = self._buf[self._pos :]
            out.extend(self._to_content(rest))
            return False
        if st == "start":
            seen = self._literal(OPEN)
            if seen is None:
                return False
            if not seen:
                out.extend(self._to_content(self._buf))
                return False
            self._state = "head"
            return True
        if st == "sep":
            seen = self._literal(SEP + OPEN)
            if seen is None:
                return False
            self._state = "head" if seen else "broken"
            return True
        lit = {"head": _HEAD, "mid": _MID, "tail": _END}.get(st)
        if lit is not None:
            seen = self._literal(lit)
            if seen is None:
                return False
            self._state = {"head": "name", "mid": "args", "tail": "sep"}[st] if seen else "broken"
            if st == "tail" and seen:
                self.calls[-1].complete = True
            return True
        if st == "name":
            end = self._buf.find('"', self._pos)
            if end < 0:
                return False
            self.calls.append(ParsedCall(self._buf[self._pos : end], ""))
            out.append(CallStart(len(self.calls) - 1, self.calls[-1].name))
            self._pos, self._state = end, "mid"
            return True
        return self._scan_arguments(out)

    def _scan_arguments(self, out: list[Event]) -> bool:
        """Moves over the arguments' JSON, tracking strings and nesting, until its value closes."""
        start = i = self._pos
        done = False
        while i < len(self._buf) and not done:
            c = self._buf[i]
            i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                done = self._depth == 0
        piece = self._buf[start:i]
        self._pos = i
        if piece:
            self.calls[-1].arguments += piece
            out.append(CallArguments(len(self.calls) - 1, piece))
        if done:
            self._state = "tail"
        return done


def parse_tool_calls(text: str, text_only: bool = False) -> ToolCallParser:
    """``text`` parsed whole: ``.content`` and ``.calls`` (``complete`` False for a call the text cut off)."""
    parser = ToolCallParser(text_only)
    parser.feed(text)
    parser.finish()
    return parser
