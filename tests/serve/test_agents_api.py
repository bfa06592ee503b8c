"""What agent frameworks send, against one real `pie serve` on the default model, through the real `openai` client:
tool calls (required and named calls whose arguments validate against their schemas, streamed deltas reassembled
by the client's own stream helper, greedy output under the tool grammar equal with and without speculation, tool
results fed back), /v1/embeddings (float and base64, pooling, refusals) and /v1/responses (whole, streamed typed
events, function tools, previous_response_id); and a custom drafter (the tutorial's, in --inferlets DIR) served
as the model MODEL:my-drafter and by the request field ``inferlet``, greedy output equal to text-completion's,
streamed, stopped and with logprobs."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from pie_runtime.store import DEFAULT_MODEL
from tests.conftest import REPO
from tests.serve.server_proc import start_serve

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
TOOLS = {
    "get_weather": ("Get the current weather in a city", WEATHER),
    "book_flight": (
        "Book a flight",
        {
            "type": "object",
            "properties": {
                "route": {
                    "type": "object",
                    "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
                    "required": ["from", "to"],
                    "additionalProperties": False,
                },
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "class": {"enum": ["economy", "business"]},
            },
            "required": ["route", "passengers"],
            "additionalProperties": False,
        },
    ),
    "search": (
        "Search the web",
        {
            "type": "object",
            "properties": {"query": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["query", "tags"],
        },
    ),
    "now": ("The current time", None),
}
USER = [{"role": "user", "content": "What is the weather in Paris? I also need a flight from Paris to Rome."}]


def tools(names=None) -> list:
    out = []
    for name, (desc, params) in TOOLS.items():
        if names is None or name in names:
            fn = {"name": name, "description": desc, **({"parameters": params} if params else {})}
            out.append({"type": "function", "function": fn})
    return out


DRAFTER = f"{DEFAULT_MODEL}:my-drafter"  # the tutorial's bigram drafter, served as a model (custom_models.py)


@pytest.fixture(scope="module")
def server(pie_home, tmp_path_factory):
    custom = tmp_path_factory.mktemp("custom")
    shutil.copy(REPO / "examples" / "bigram_drafter.py", custom / "my-drafter.py")
    (custom / "dicty.py").write_text("import inferlet\n\n@inferlet.main\nasync def main(args: dict):\n    return {}\n")
    flags = ["--max-tokens", "256", "--kv-pages", "1024", "--inferlets", str(custom)]
    s = start_serve(pie_home, DEFAULT_MODEL, *flags)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=300)


def check_call(call, only: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in TOOLS and (only is None or call.function.name == only)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[call.function.name][1] or {"type": "object", "properties": {}})
    return args


def test_named_and_required_calls_validate_whole_and_streamed(client):
    kw = dict(model=DEFAULT_MODEL, messages=USER, tools=tools(), temperature=0, max_tokens=80)
    for name in TOOLS:
        choice = {"type": "function", "function": {"name": name}}
        out = client.chat.completions.create(tool_choice=choice, **kw)  # type: ignore[arg-type]
        msg, reason = out.choices[0].message, out.choices[0].finish_reason
        assert reason == "tool_calls" and msg.content is None and msg.tool_calls and len(msg.tool_calls) == 1
        whole = check_call(msg.tool_calls[0], only=name)
        if name in ("get_weather", "now"):
            continue  # streamed below and in test_streamed_call_deltas_follow_openai
        # streamed: the client's own helper reassembles the deltas into the same call
        with client.chat.completions.stream(tool_choice=choice, **kw) as stream:  # type: ignore[arg-type]
            final = stream.get_final_completion()
        calls = final.choices[0].message.tool_calls
        assert final.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1
        assert check_call(calls[0], only=name) == whole
    out = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)  # type: ignore[arg-type]
    assert out.choices[0].finish_reason == "tool_calls" and len(out.choices[0].message.tool_calls or []) == 1
    check_call((out.choices[0].message.tool_calls or [])[0])


def test_streamed_call_deltas_follow_openai(client):
    chunks = list(
        client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=USER,  # type: ignore[arg-type]
            tools=tools(["get_weather"]),  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
            stream=True,
        )
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].index == 0 and deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    pieces = [d.function.arguments for d in deltas[1:] if d.function]
    assert len(pieces) >= 2 and all(d.index == 0 and d.id is None for d in deltas[1:])
    jsonschema.validate(json.loads("".join(p or "" for p in pieces)), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_greedy_calls_under_the_grammar_equal_with_and_without_speculation(client):
    kw = dict(
        model=DEFAULT_MODEL,
        messages=USER,
        tools=tools(),
        tool_choice="required",
        parallel_tool_calls=False,  # one call, then the output ends
        temperature=0,
        max_tokens=96,
    )
    spec = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})  # type: ignore[arg-type]
    off = {"speculation": False, "return_token_ids": True}
    plain = client.chat.completions.create(**kw, extra_body=off)  # type: ignore[arg-type]
    assert spec.choices[0].token_ids == plain.choices[0].token_ids  # type: ignore[attr-defined]
    calls = [(c.function.name, c.function.arguments) for c in spec.choices[0].message.tool_calls or []]
    without = [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls or []]
    assert calls and calls == without
    assert spec.usage and plain.usage and spec.usage.completion_tokens == plain.usage.completion_tokens
    assert spec.speculation["proposed"] > 0  # type: ignore[attr-defined]  # drafts ran (forced tokens at least)
    assert "speculation" not in plain.model_extra or not plain.speculation["proposed"]  # type: ignore[attr-defined]


def test_auto_is_text_or_whole_calls_and_results_feed_back(client):
    kw = dict(model=DEFAULT_MODEL, tools=tools(["get_weather"]), temperature=0, max_tokens=32)
    auto = client.chat.completions.create(messages=USER, tool_choice="auto", **kw)  # type: ignore[arg-type]
    msg = auto.choices[0].message
    if msg.tool_calls:
        assert auto.choices[0].finish_reason == "tool_calls" and not msg.content
        check_call(msg.tool_calls[0])
    else:
        assert "<tool_call>" not in (msg.content or "")
    one_call = {**kw, "max_tokens": 96, "parallel_tool_calls": False}
    first = client.chat.completions.create(messages=USER, tool_choice="required", **one_call)  # type: ignore[arg-type]
    call = (first.choices[0].message.tool_calls or [])[0]
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"},
    ]
    answer = client.chat.completions.create(messages=history, **kw)  # type: ignore[arg-type]
    assert answer.usage and first.usage and answer.usage.prompt_tokens > first.usage.prompt_tokens
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    plain = client.chat.completions.create(messages=history, model=DEFAULT_MODEL, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert plain.choices[0].message.tool_calls is None  # no tools: the history renders, nothing is parsed


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": tools(["now"]), "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": tools(["now"]) * 2}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        ({"tools": tools(["now"]), "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_tool_requests_that_cannot_be_served_are_400s(server, extra, param):
    body = {"model": DEFAULT_MODEL, "messages": USER, "max_tokens": 4, **extra}
    r = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_embeddings(client, server):
    texts = ["The cat sat on the mat.", "A cat was sitting on the mat.", "Stock markets fell sharply today."]
    out = client.embeddings.create(model=DEFAULT_MODEL, input=texts)  # the client asks for base64 and decodes it
    v = np.array([d.embedding for d in out.data])
    assert v.shape == (3, 576) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2]  # the paraphrase is nearer than the unrelated sentence
    floats = client.embeddings.create(model=DEFAULT_MODEL, input=texts[0], encoding_format="float")
    assert np.array_equal(np.array(floats.data[0].embedding, dtype=np.float32), v[0].astype(np.float32))
    ids = httpx.post(f"{server.base}/tokenize", json={"prompt": texts[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model=DEFAULT_MODEL, input=[ids], encoding_format="float")
    assert by_ids.data[0].embedding == floats.data[0].embedding and by_ids.usage.prompt_tokens == len(ids)
    last = client.embeddings.create(model=DEFAULT_MODEL, input=texts[0], extra_body={"pooling": "last"})
    assert not np.allclose(last.data[0].embedding, v[0]) and np.isclose(np.linalg.norm(last.data[0].embedding), 1)
    refused = [({"dimensions": 64}, "dimensions"), ({"input": ""}, "input"), ({"input": [[99999999]]}, "input")]
    for body, param in refused:
        r = httpx.post(f"{server.base}/v1/embeddings", json={"model": DEFAULT_MODEL, "input": "x", **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_responses_whole_streamed_and_continued(client, server):
    kw = dict(model=DEFAULT_MODEL, instructions="Answer in one short sentence.", max_output_tokens=40, temperature=0)
    whole = client.responses.create(input="What is the capital of France?", **kw)  # type: ignore[arg-type]
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage and whole.usage.output_tokens >= 1
    events = list(client.responses.create(input="What is the capital of France?", stream=True, **kw))  # type: ignore[arg-type]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{whole.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    listed = client.responses.create(
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}], **kw
    )
    assert listed.output_text == whole.output_text
    later = client.responses.create(input="And of Italy?", previous_response_id=whole.id, **kw)  # type: ignore[arg-type]
    assert later.usage and later.usage.input_tokens > whole.usage.input_tokens + whole.usage.output_tokens
    # the earlier turn's working set continues from the key's prefix cache: at least every full page of its
    # prompt (16-token pages, the engine's default) is not computed again, with what it generated after them
    # as far as it retokenizes the same
    assert later.usage.input_tokens_details.cached_tokens >= whole.usage.input_tokens // 16 * 16 >= 16
    r = httpx.post(
        f"{server.base}/v1/responses",
        json={"model": DEFAULT_MODEL, "input": "x", "previous_response_id": "resp-none"},
        timeout=60,
    )
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_responses_function_tools_two_steps(client):
    fn = {"type": "function", "name": "get_weather", "description": "Get the weather", "parameters": WEATHER}
    kw = dict(model=DEFAULT_MODEL, tools=[fn], temperature=0, max_output_tokens=60, parallel_tool_calls=False)
    with client.responses.stream(input="Weather in Paris?", tool_choice="required", **kw) as stream:  # type: ignore[arg-type]
        first = stream.get_final_response()
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees and sunny"}
    second = client.responses.create(input=[output], previous_response_id=first.id, tool_choice="none", **kw)  # type: ignore[arg-type]
    assert second.output[0].type == "message" and second.output_text


def test_langchain_drives_a_two_step_tool_loop(server):
    """An agent framework nobody here wrote: langchain-openai's ChatOpenAI.bind_tools forces a call, the tool
    runs, its result goes back as a ToolMessage and the model answers."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, unit: str = "celsius") -> str:
        """Get the current weather in a city."""
        return f"22 degrees {unit} and sunny in {city}"

    llm = ChatOpenAI(
        model=DEFAULT_MODEL,
        base_url=f"{server.base}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=60,  # pyright: ignore[reportCallIssue]  (a field langchain's stubs show by its alias only)
        max_retries=0,
    )
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False).invoke(messages)
    assert ai.response_metadata["finish_reason"] == "tool_calls" and len(ai.tool_calls) == 1
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    messages += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert final.response_metadata["finish_reason"] in ("stop", "length") and final.content and not final.tool_calls


def counts(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_custom_drafter_serves_chat_as_a_model(client):
    ids = [m.id for m in client.models.list()]
    assert ids == [DEFAULT_MODEL, DRAFTER]  # dicty.py takes a dict: a runs-endpoint inferlet, not a model
    kw = dict(messages=[{"role": "user", "content": "Count from 1 to 30, separated by commas."}], temperature=0)
    plain = client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=64, **kw)  # type: ignore[arg-type]
    drafted = client.chat.completions.create(model=DRAFTER, max_tokens=64, **kw)  # type: ignore[arg-type]
    text = plain.choices[0].message.content or ""
    assert drafted.model == DRAFTER and drafted.choices[0].message.content == text
    assert drafted.choices[0].finish_reason == plain.choices[0].finish_reason
    assert counts(drafted.usage) == counts(plain.usage)  # (cached_tokens differ: the prefix cache)
    spec = (drafted.model_extra or {})["speculation"]  # the drafter ran: its round loop's counters
    assert spec["rounds"] > 0 and spec["proposed"] > 0
    # streamed, with logprobs and usage: the same tokens, each with its logprob, as text-completion's
    stream = client.chat.completions.create(
        model=DRAFTER,
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=2,
        **kw,  # type: ignore[arg-type]
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert "".join(e.token for e in entries) == text and all(len(e.top_logprobs) == 2 for e in entries)
    assert counts(chunks[-1].usage) == counts(plain.usage) and all(c.model == DRAFTER for c in chunks)
    whole = client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=64, logprobs=True, **kw)  # type: ignore[arg-type]
    assert whole.choices[0].logprobs and whole.choices[0].logprobs.content
    want = [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    assert [e.token for e in entries] == [t for t, _ in want]
    assert [e.logprob for e in entries] == pytest.approx([lp for _, lp in want], abs=1e-4)
    # a stop string inside the output: cut before it, finish_reason stop, as text-completion
    stop = text[len(text) // 2 :][:3]
    cut = client.chat.completions.create(model=DRAFTER, max_tokens=64, stop=[stop], **kw)  # type: ignore[arg-type]
    assert cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_custom_drafter_by_request_field_and_refusals(client):
    kw = dict(prompt="1, 2, 3, 1, 2, 3, 1, 2,", max_tokens=24, temperature=0)
    plain = client.completions.create(model=DEFAULT_MODEL, **kw)  # type: ignore[arg-type]
    drafted = client.completions.create(model=DEFAULT_MODEL, extra_body={"inferlet": "my-drafter"}, **kw)  # type: ignore[arg-type]
    assert drafted.choices[0].text == plain.choices[0].text and drafted.model == DRAFTER
    assert (drafted.model_extra or {})["speculation"]["accepted"] > 0  # the repeats are drafted and kept
    refusals = [
        ({"model": f"{DEFAULT_MODEL}:nope"}, openai.NotFoundError, "model_not_found"),
        ({"model": DEFAULT_MODEL, "extra_body": {"inferlet": "nope"}}, openai.NotFoundError, "inferlet_not_found"),
        ({"model": f"{DEFAULT_MODEL}:dicty"}, openai.BadRequestError, "inferlet_not_completion"),
        ({"model": DRAFTER, "extra_body": {"speculation": {"method": "lookup", "k": 2}}}, openai.BadRequestError, None),
    ]
    for extra, error, code in refusals:
        with pytest.raises(error) as e:
            client.completions.create(**{**kw, **extra})  # type: ignore[call-overload]
        assert e.value.code == code, e.value
