"""The tool-call grammar and parser (inferlet.text.tool_calls) over generated tool definitions (nested objects, enums,
arrays, optional fields, numbers with bounds, refs): text walked through the grammar token by token (the default
model's real tokenizer under llguidance, a seeded random choice among the tokens each mask allows, biased toward
closing characters so strings and arrays end) always parses into calls of a given function whose arguments
validate against its schema (jsonschema); "auto" admits free text and never a text holding a call's opening tag;
the streaming parser's events, fed in random pieces, rebuild the whole text's calls. Only the model is replaced
(a random choice among the allowed tokens is a worst case for a grammar: any continuation it allows is taken)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from inferlet.text.grammar import Constraint
from inferlet.text.tool_calls import (
    CallArguments,
    CallStart,
    Content,
    ToolCallParser,
    parse_tool_calls,
    render_call,
    tool_call_grammar,
)
from inferlet.tokenizer import Tokenizer
from pie_runtime.store import DEFAULT_MODEL, ModelStore

DEFINITIONS = 120  # generated tool sets; each is walked once under "required" and once named
MAX_STEPS = 1500
STOP_CHANCE = 0.8  # the chance a step ends the text where the grammar allows it (else another call may follow)
CLOSE_BIAS = 0.7  # the chance a step picks among the allowed tokens made of closing characters only
CLOSERS = set('"}]0123456789, :')


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    folder = Path(ModelStore().path(DEFAULT_MODEL))
    cfg = json.loads((folder / "manifest.json").read_text())["config"]
    return Tokenizer((folder / "tokenizer.json").read_text(), cfg["eos_token_ids"], cfg["bos_token_id"], None)


@pytest.fixture(scope="module")
def closing(tok: Tokenizer) -> np.ndarray:
    """The token ids whose text is closing characters only."""
    ids = [i for i in range(tok.vocab_size) if (t := tok.decode([i])) and set(t) <= CLOSERS]
    return np.array(ids)


def gen_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON schema of a value, nested up to depth 2."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array", "object"] if depth < 2 else ["string", "enum"]
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "celsius", "fahrenheit", "a b"], 3)}
    if kind == "integer":
        return {"type": "integer", "minimum": rng.randint(-5, 0), "maximum": rng.randint(1, 100)}
    if kind == "number":
        return {"type": "number"}
    if kind == "array":
        return {"type": "array", "items": gen_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    if kind == "object":
        return gen_object(rng, depth + 1)
    return {"type": kind, "description": "a value"}


def gen_object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["city", "unit", "days", "query", "limit", "tags", "options", "when", "flag"], rng.randint(1, 4))
    props = {n: gen_schema(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    schema: dict = {"type": "object", "properties": props, "required": required}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def gen_tools(rng: random.Random) -> dict[str, dict | None]:
    tools: dict[str, dict | None] = {}
    for i in range(rng.randint(1, 4)):
        name = rng.choice(["get_weather", "search", "book-flight", "lookup_2", "calc"]) + f"_{i}"
        tools[name] = None if rng.random() < 0.1 else gen_object(rng)
    if rng.random() < 0.2:  # a schema with a $ref into its own $defs
        tools["with_ref"] = {
            "type": "object",
            "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
            "properties": {"at": {"$ref": "#/$defs/point"}},
            "required": ["at"],
        }
    return tools


def walk(tok: Tokenizer, grammar: str, rng: random.Random, closing: np.ndarray) -> tuple[str, bool]:
    """Text written token by token under the grammar (module docstring); whether the grammar accepted its end."""
    c = Constraint(tok, tok.vocab_size, grammar)
    eos_ids = np.array(sorted(c.eos))
    ids: list[int] = []
    for _ in range(MAX_STEPS):
        if c.matcher.is_stopped():
            break
        mask = c.masks([])[0]
        allowed = np.flatnonzero((mask.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1)
        allowed = allowed[allowed < tok.vocab_size]
        at_end = np.isin(allowed, eos_ids)
        if at_end.any() and (rng.random() < STOP_CHANCE or at_end.all()):
            break
        allowed = allowed[~at_end]
        near = np.intersect1d(allowed, closing, assume_unique=True)
        pool = near if len(near) and rng.random() < CLOSE_BIAS else allowed
        t = int(pool[rng.randrange(len(pool))])
        c.consume([t])
        ids.append(t)
    return tok.decode(ids), c.is_accepting()


def check_calls(text: str, tools: dict[str, dict | None], only: str | None = None) -> int:
    parsed = parse_tool_calls(text)
    assert parsed.content == "" and parsed.calls and all(call.complete for call in parsed.calls), text
    for call in parsed.calls:
        assert call.name in tools and (only is None or call.name == only), text
        jsonschema.validate(json.loads(call.arguments), tools[call.name] or {"type": "object"})
    return len(parsed.calls)


def test_required_and_named_calls_always_validate(tok, closing):
    rng = random.Random(59)
    calls = 0
    for _ in range(DEFINITIONS):
        tools = gen_tools(rng)
        text, accepting = walk(tok, tool_call_grammar(tools, "required", parallel=True), rng, closing)
        assert accepting, text
        calls += check_calls(text, tools)
        name = rng.choice(list(tools))
        text, accepting = walk(tok, tool_call_grammar({name: tools[name]}, "required", parallel=False), rng, closing)
        assert accepting and check_calls(text, tools, only=name) == 1, text
    assert calls > DEFINITIONS  # some walks made parallel calls


def test_auto_is_free_text_or_whole_calls(tok):
    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    c = Constraint(tok, tok.vocab_size, tool_call_grammar(tools, "auto", parallel=True))
    ok = render_call("get_weather", {"city": "Paris"}) + "\n" + render_call("get_weather", '{"city": "Rome"}')
    for text, valid in [
        ("It is sunny in Paris today.", True),
        (ok, True),
        ("Let me check. <tool_call>\n{}", False),  # a call inside text is never text
        (render_call("get_weather", {"town": "Paris"}), False),  # missing the required field
        (render_call("set_weather", {"city": "Paris"}), False),  # a function that was not given
    ]:
        ids = tok.encode(text)
        assert (c.matcher.validate_tokens(ids) == len(ids)) == valid, text
    parsed = parse_tool_calls(ok)
    assert [(p.name, json.loads(p.arguments)) for p in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert parse_tool_calls("<tool").content == "<tool" and parse_tool_calls("Hi there").content == "Hi there"


def test_streamed_events_rebuild_the_calls_in_any_pieces():
    text = (
        render_call("a", {"s": 'he said "}</tool_call>" {[', "n": [1, {"x": "]"}]})
        + "\n"
        + render_call("b-2", {})
        + "\n"
        + render_call("c", {"t": "\\"})
    )
    rng = random.Random(7)
    for _ in range(50):
        parser = ToolCallParser()
        events = []
        i = 0
        while i < len(text):
            step = rng.randint(1, 9)
            events += parser.feed(text[i : i + step])
            i += step
        events += parser.finish()
        names = [(e.index, e.name) for e in events if isinstance(e, CallStart)]
        args: dict[int, str] = {}
        for e in events:
            if isinstance(e, CallArguments):
                args[e.index] = args.get(e.index, "") + e.text
        assert names == [(0, "a"), (1, "b-2"), (2, "c")]
        assert json.loads(args[0]) == {"s": 'he said "}</tool_call>" {[', "n": [1, {"x": "]"}]}
        assert json.loads(args[1]) == {} and json.loads(args[2]) == {"t": "\\"}
        assert not any(isinstance(e, Content) for e in events) and all(c.complete for c in parser.calls)
    cut = parse_tool_calls(render_call("a", {"x": 1})[:-5])  # cut off before its end: not a complete call
    assert [c.complete for c in cut.calls] == [False]
