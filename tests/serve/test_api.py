"""The HTTP API of a real `pie serve` (tiny random model: outputs do not matter here, shapes and behaviour do)
driven with the real `openai` client and with raw HTTP for every bad input; custom inferlet runs; health while
loading; SIGTERM drain with no child left behind (the module's last test)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pie_runtime.store import DEFAULT_MODEL, ModelStore
from tests.conftest import TINY
from tests.serve.server_proc import alive, children, port_open, start_serve

pytestmark = pytest.mark.e2e

CUSTOM = Path(__file__).parent / "api_inferlets"
MAX_N, MAX_TOKENS, MAX_RUNNING = 4, 64, 4


@pytest.fixture(scope="module")
def server(pie_home, tmp_path_factory):
    # the tiny model has no chat template: serve it with the default model's (ChatML)
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(ModelStore(pie_home / "models").get(DEFAULT_MODEL).tokenizer.chat_template or "")
    s = start_serve(
        pie_home,
        TINY,
        "--chat-template",
        str(template),
        "--no-prefix-cache",
        "--kv-pages",
        "256",
        "--pass-cost-rows",
        "0",
        "--inferlets",
        str(CUSTOM),
        "--max-n",
        str(MAX_N),
        "--max-tokens",
        str(MAX_TOKENS),
        "--max-body-bytes",
        "65536",
        "--max-running",
        str(MAX_RUNNING),
        "--drain-timeout",
        "60",
        "--allow-upload",
        "--upload-memory",
        "3072",
        watch_loading=True,
        env={"PIE_TEST_SECRET": "s3cret"},
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


def post(server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{server.base}{path}", content=body, headers={"content-type": "application/json"}, **kw)
    return httpx.post(f"{server.base}{path}", json=body, **{"timeout": 120, **kw})


def assert_error(r: httpx.Response, status: int, type_: str, param: str | None = None, code: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_ and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_health_is_503_while_loading_then_200(server):
    assert 503 in server.statuses_while_loading
    assert server.completion_while_loading is not None
    assert server.completion_while_loading["status"] == 503
    assert server.completion_while_loading["error"]["code"] == "starting"
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [TINY]


def test_completion_stream_equals_whole(client):
    kw = dict(model=TINY, prompt="The capital of France is", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion"
    assert len(whole.choices) == 1 and whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage is not None and whole.usage.completion_tokens >= 1
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.usage.prompt_tokens_details is not None and whole.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_uses_the_template_and_streams(client, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=TINY, messages=messages, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    counted = post(server, "/tokenize", {"model": TINY, "messages": messages}).json()["count"]
    assert whole.usage is not None and whole.usage.prompt_tokens == counted
    stream = client.chat.completions.create(
        model=TINY,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == counted


def test_tokenize_detokenize_round_trip(server):
    ids = post(server, "/tokenize", {"model": TINY, "prompt": "Hello, world"}).json()["tokens"]
    assert ids and post(server, "/detokenize", {"model": TINY, "tokens": ids}).json()["prompt"] == "Hello, world"


def test_n_choices(client):
    out = client.completions.create(model=TINY, prompt="Once", max_tokens=6, temperature=1.0, seed=7, n=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage is not None and out.usage.completion_tokens >= 3
    again = client.completions.create(model=TINY, prompt="Once", max_tokens=6, temperature=1.0, seed=7, n=3)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible


def test_response_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    value = json.loads(out.choices[0].message.content or "")
    assert isinstance(value["ok"], bool) and set(value) == {"ok"}


def test_logprobs(client):
    out = client.completions.create(model=TINY, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens  # type: ignore[union-attr]
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)


def test_chat_logprobs_and_top_logprobs(client):
    out = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == out.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(
            entry.logprob
        )
        assert bytes(entry.bytes or []).decode(errors="replace") == entry.token
    # streamed, the same entries arrive over the chunks (with the finishing chunk)
    chunks = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_streamed_logprobs_ride_with_their_chunks(client):
    """stream + logprobs: each text chunk carries its own tokens' logprobs (not all in the finishing chunk), in
    each dialect's shape, and together they are the whole response's (completions: text offsets continue)."""
    kw = dict(model=TINY, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt="Hello", logprobs=2, **kw)
    chunks = [c for c in client.completions.create(prompt="Hello", logprobs=2, stream=True, **kw) if c.choices]
    texts = [c for c in chunks if c.choices[0].text and c.choices[0].finish_reason is None]
    assert len(texts) >= 2 and all(c.choices[0].logprobs and c.choices[0].logprobs.tokens for c in texts)
    lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    tokens = [t for lp in lps for t in lp.tokens or []]
    offsets = [o for lp in lps for o in lp.text_offset or []]
    want = whole.choices[0].logprobs
    assert want is not None and tokens == want.tokens and offsets == want.text_offset
    assert [v for lp in lps for v in lp.token_logprobs or []] == want.token_logprobs
    assert [t for lp in lps for t in lp.top_logprobs or []] == want.top_logprobs
    messages = [{"role": "user", "content": "Hi"}]
    chat = dict(messages=messages, logprobs=True, top_logprobs=2, **kw)
    whole_chat = client.chat.completions.create(**chat)  # type: ignore[arg-type]
    stream = [c for c in client.chat.completions.create(**chat, stream=True) if c.choices]  # type: ignore[arg-type]
    deltas = [c for c in stream if c.choices[0].delta.content and c.choices[0].finish_reason is None]
    assert len(deltas) >= 2 and all(c.choices[0].logprobs and c.choices[0].logprobs.content for c in deltas)
    streamed = [e for c in stream if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    content = whole_chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content or []]
    assert all(len(e.top_logprobs) == 2 for e in streamed)
    # a speculative inferlet decodes logprobs runs plainly (sdk/inferlet/decode.py) and streams them the same way
    lookup = {"ignore_eos": True, "speculation": {"method": "lookup", "k": 2}}
    spec = [
        c for c in client.completions.create(**{**kw, "extra_body": lookup}, prompt="Hello", logprobs=2, stream=True)
    ]
    spec_texts = [c for c in spec if c.choices and c.choices[0].text and c.choices[0].finish_reason is None]
    assert len(spec_texts) >= 2 and all(c.choices[0].logprobs and c.choices[0].logprobs.tokens for c in spec_texts)
    spec_lps = [c.choices[0].logprobs for c in spec if c.choices and c.choices[0].logprobs]
    assert [v for lp in spec_lps for v in lp.token_logprobs or []] == want.token_logprobs


def test_logit_bias_steers_every_token(client, server):
    token = post(server, "/tokenize", {"model": TINY, "prompt": " blue"}).json()["tokens"][0]
    out = client.completions.create(
        model=TINY,
        prompt="Once",
        max_tokens=4,
        temperature=0,
        logit_bias={str(token): 100},
        extra_body={"return_token_ids": True},
    )
    assert out.choices[0].token_ids == [token] * 4  # type: ignore[attr-defined]


GREEDY = dict(model=TINY, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})


def test_stop_strings_cut_the_text(client):
    full = client.completions.create(prompt="Once upon a time", **GREEDY).choices[0].text  # type: ignore[arg-type]
    stop = full[6:9]
    assert stop.strip() and len(full) > 9
    cut = full[: full.index(stop)]
    for stops in (stop, ["never-in-the-text", stop]):
        out = client.completions.create(prompt="Once upon a time", stop=stops, **GREEDY).choices[0]  # type: ignore[arg-type]
        assert (out.text, out.finish_reason) == (cut, "stop")
    messages = [{"role": "user", "content": "Go on."}]
    chat_full = client.chat.completions.create(messages=messages, **GREEDY).choices[0].message.content or ""  # type: ignore[arg-type]
    chat_stop = chat_full[4:7]
    chat = client.chat.completions.create(messages=messages, stop=["zzz-none", chat_stop], **GREEDY).choices[0]  # type: ignore[arg-type]
    assert chat.message.content == chat_full[: chat_full.index(chat_stop)] and chat.finish_reason == "stop"


def test_max_completion_tokens_bounds_the_output(client):
    out = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "Count."}],
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None and out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_echo_prepends_the_prompt_whole_and_streamed(client):
    plain = client.completions.create(prompt="Once upon", **GREEDY).choices[0].text  # type: ignore[arg-type]
    echoed = client.completions.create(prompt="Once upon", echo=True, **GREEDY).choices[0].text  # type: ignore[arg-type]
    assert echoed == "Once upon" + plain
    chunks = client.completions.create(prompt="Once upon", echo=True, stream=True, **GREEDY)  # type: ignore[arg-type]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed


def test_unsupported_completion_fields_are_400s(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=TINY, prompt="def f(", suffix="return x", max_tokens=2)
    assert e.value.param == "suffix"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=TINY, prompt="Hi", echo=True, logprobs=1, max_tokens=2)
    assert e.value.param == "echo"  # type: ignore[attr-defined]


def test_token_id_prompts_run_as_given(client, server):
    ids = post(server, "/tokenize", {"model": TINY, "prompt": "Once upon a time"}).json()["tokens"]
    as_text = client.completions.create(prompt="Once upon a time", **GREEDY)  # type: ignore[arg-type]
    for prompt in (ids, [ids]):
        as_ids = client.completions.create(prompt=prompt, **GREEDY)  # type: ignore[arg-type]
        assert as_ids.choices[0].text == as_text.choices[0].text
        assert as_ids.usage is not None and as_ids.usage.prompt_tokens == len(ids)
    # spelled letter by letter: 5 tokens where "hello" encodes to fewer; they run as given, not re-encoded
    letters = [post(server, "/tokenize", {"model": TINY, "prompt": c}).json()["tokens"][0] for c in "hello"]
    spelled = client.completions.create(prompt=letters, **GREEDY)  # type: ignore[arg-type]
    assert spelled.usage is not None and spelled.usage.prompt_tokens == 5
    assert len(post(server, "/tokenize", {"model": TINY, "prompt": "hello"}).json()["tokens"]) < 5


BAD = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny-smol", "prompt": ', 400, "invalid_request_error", None),
    ("wrong type", "/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": "many"}, 400, None, "max_tokens"),
    ("wrong range", "/v1/completions", {"model": TINY, "prompt": "x", "temperature": 9}, 400, None, "temperature"),
    ("no messages", "/v1/chat/completions", {"model": TINY, "messages": []}, 400, None, "messages"),
    ("n past limit", "/v1/completions", {"model": TINY, "prompt": "x", "n": MAX_N + 1}, 400, None, "n"),
    (
        "max_tokens past limit",
        "/v1/completions",
        {"model": TINY, "prompt": "x", "max_tokens": MAX_TOKENS + 1},
        400,
        None,
        "max_tokens",
    ),
    ("empty prompt", "/v1/completions", {"model": TINY, "prompt": ""}, 400, None, "prompt"),
    ("lone surrogate", "/v1/completions", b'{"model": "tiny-smol", "prompt": "a\\ud800"}', 400, None, "prompt"),
    (
        "lone surrogate in chat",
        "/v1/chat/completions",
        b'{"model": "tiny-smol", "messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        None,
        "messages",
    ),
    (
        "bias out of vocab",
        "/v1/completions",
        {"model": TINY, "prompt": "x", "logit_bias": {"99999": 1}},
        400,
        None,
        "logit_bias",
    ),
    ("top_k past 64 bits", "/v1/completions", {"model": TINY, "prompt": "x", "top_k": 10**30}, 400, None, "top_k"),
    (
        "bad stop id",
        "/v1/completions",
        {"model": TINY, "prompt": "x", "stop_token_ids": [-1]},
        400,
        None,
        "stop_token_ids.0",
    ),
    ("prompt past context", "/v1/completions", {"model": TINY, "prompt": "hello " * 2100}, 400, None, "prompt"),
    (
        "bad schema",
        "/v1/chat/completions",
        {
            "model": TINY,
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
        },
        400,
        None,
        "response_format",
    ),
    ("unknown model", "/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "not_found_error", "model"),
    ("unknown inferlet", "/v1/inferlets/no-such/runs", {"args": {}}, 404, "not_found_error", None),
    ("run args past 64 bits", "/v1/inferlets/echo/runs", {"args": {"x": 10**30}}, 400, None, None),
    (
        "a host path to write",
        "/v1/inferlets/suffix-speculative-decoding/runs",
        {"args": {"prompt": "x", "save_index": "/tmp/pie-written-by-a-request"}},
        400,
        None,
        "args.save_index",
    ),
    (
        "a host path to read",
        "/v1/inferlets/suffix-speculative-decoding/runs",
        {"args": {"prompt": "x", "suffix-index": "/etc/passwd"}},
        400,
        None,
        "args.suffix-index",
    ),
    ("body too large", "/v1/completions", {"model": TINY, "prompt": "x" * 70000}, 413, None, None),
]


@pytest.mark.parametrize(("path", "body", "status", "type_", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_inputs_get_openai_errors(server, path, body, status, type_, param):
    r = post(server, path, body)
    assert_error(r, status, type_ or ("invalid_request_error" if status in (400, 413) else "not_found_error"), param)
    # ... and the server keeps serving
    ok = post(server, "/v1/completions", {"model": TINY, "prompt": "still there?", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_inferlets_listed(server):
    data = httpx.get(f"{server.base}/v1/inferlets").json()["data"]
    by_id = {d["id"]: d["source"] for d in data}
    assert by_id["text-completion"] == "shipped" and by_id["echo"] == "custom" and by_id["boom"] == "custom"


def test_custom_run_whole_and_streamed(server):
    r = post(server, "/v1/inferlets/echo/runs", {"args": {"x": 1}})
    assert r.status_code == 200 and r.json()["result"] == {"echo": {"x": 1}}
    assert r.headers["x-pie-run-id"] == r.json()["id"]
    with httpx.stream("POST", f"{server.base}/v1/inferlets/echo/runs", json={"args": {}, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [e["type"] for e in events][0] == "run" and events[-1] == {"type": "result", "result": {"echo": {}}}
    assert "".join(e["text"] for e in events if e["type"] == "text") == "hello world"


def test_raising_inferlet_is_a_500_and_the_server_stays_up(server):
    r = post(server, "/v1/inferlets/boom/runs", {})
    assert r.status_code >= 500
    err = r.json()["error"]
    assert err["code"] == "inferlet_error" and "boom: the inferlet gave up" in err["message"]
    assert post(server, "/v1/inferlets/echo/runs", {}).status_code == 200


UPLOADED = """
import os
import resource

import inferlet


@inferlet.main
async def main(args: dict) -> dict:
    inferlet.emit("up")
    return {"env": sorted(os.environ), "as": resource.getrlimit(resource.RLIMIT_AS)[0], "x": args.get("x")}
"""


def test_uploaded_inferlet_runs_limited_and_without_the_servers_environment(server):
    r = post(server, "/v1/inferlets", {"name": "uploaded-env", "source": UPLOADED})
    assert r.status_code == 200, r.text
    listed = {d["id"]: d["source"] for d in httpx.get(f"{server.base}/v1/inferlets").json()["data"]}
    assert listed["uploaded-env"] == "uploaded"
    result = post(server, "/v1/inferlets/uploaded-env/runs", {"args": {"x": 3}}).json()["result"]
    assert result["x"] == 3 and result["as"] == 3072 << 20
    assert "PIE_TEST_SECRET" not in result["env"] and "PIE_HOME" not in result["env"]
    # the server's own inferlets keep their names, and source that does not compile is refused
    assert_error(post(server, "/v1/inferlets", {"name": "echo", "source": "x = 1"}), 409, "invalid_request_error")
    assert_error(post(server, "/v1/inferlets", {"name": "bad", "source": "def ("}), 400, "invalid_request_error")


def metric(server, name: str, **labels: str) -> float:
    """The sum of a /metrics family's samples whose labels include ``labels``."""
    page = httpx.get(f"{server.base}/metrics").text
    for family in text_string_to_metric_families(page):
        if family.name == name:  # a counter's samples: NAME_total (and NAME_created, left out)
            samples = [s for s in family.samples if s.name in (name, f"{name}_total")]
            return sum(s.value for s in samples if labels.items() <= s.labels.items())
    return 0.0  # a labelled family with no sample yet is not on the page


def kv_pages_used(server) -> float:
    return metric(server, "pie_kv_pages_used")


def wait_for(check, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@contextlib.contextmanager
def holding(server, count: int):
    """``count`` runs of the holder inferlet, streamed, each holding its pages until its client leaves (the
    end of the block closes the connections)."""
    readers = []  # kept: a line iterator that is dropped closes its response
    with contextlib.ExitStack() as stack:
        for _ in range(count):
            url = f"{server.base}/v1/inferlets/holder/runs"
            s = stack.enter_context(
                httpx.stream("POST", url, json={"args": {"tokens": 20}, "stream": True}, timeout=60)
            )
            readers.append(s.iter_lines())
            while "holding" not in next(readers[-1]):
                pass
        assert metric(server, "pie_requests_running") == count
        yield


def test_a_client_that_leaves_cancels_its_request_streamed_or_not(server):
    before = kv_pages_used(server)
    cancelled = metric(server, "pie_requests", inferlet="holder", outcome="cancelled")
    with holding(server, MAX_RUNNING):  # every run slot taken: a new request waits for one
        assert kv_pages_used(server) > before
        for stream in (False, True):
            body = {"model": TINY, "prompt": "waits", "max_tokens": 4, "stream": stream}
            with pytest.raises(httpx.ReadTimeout):
                post(server, "/v1/completions", body, timeout=httpx.Timeout(30, read=1.0))
            wait_for(lambda: metric(server, "pie_requests_waiting") == 0)  # the waiting request left the queue
    # the holders' streams were closed mid-run: their runs are cancelled and their pages back
    wait_for(lambda: kv_pages_used(server) == before)
    # a whole (non-streamed) run whose client leaves while it runs
    url = f"{server.base}/v1/inferlets/holder/runs"
    leaving = threading.Thread(
        target=lambda: pytest.raises(
            httpx.ReadTimeout, httpx.post, url, json={"args": {}}, timeout=httpx.Timeout(30, read=2.0)
        )
    )
    leaving.start()
    wait_for(lambda: kv_pages_used(server) > before)
    leaving.join()
    wait_for(lambda: kv_pages_used(server) == before)
    wait_for(
        lambda: metric(server, "pie_requests", inferlet="holder", outcome="cancelled") == cancelled + MAX_RUNNING + 1
    )
    assert post(server, "/v1/completions", {"model": TINY, "prompt": "next", "max_tokens": 2}).status_code == 200


def test_a_completion_stream_closed_mid_run_is_cancelled(server):
    before = kv_pages_used(server)
    labels = {"inferlet": "text-completion", "outcome": "cancelled"}
    cancelled = metric(server, "pie_requests", **labels)
    # long enough to be running when the client leaves: 4 choices of 64 tokens over a 1,500-token prompt
    body = {"model": TINY, "prompt": "hello " * 1500, "max_tokens": MAX_TOKENS, "n": MAX_N, "stream": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", json={**body, "ignore_eos": True}, timeout=60) as s:
        next(line for line in s.iter_lines() if line.startswith("data: "))
    wait_for(lambda: metric(server, "pie_requests", **labels) == cancelled + 1)
    wait_for(lambda: kv_pages_used(server) == before)


def test_cancel_releases_the_runs_pages(server):
    before = kv_pages_used(server)
    url = f"{server.base}/v1/inferlets/holder/runs"
    with httpx.stream("POST", url, json={"args": {"tokens": 300}, "stream": True}, timeout=120) as s:
        run_id = s.headers["x-pie-run-id"]
        lines = s.iter_lines()
        while "holding" not in next(lines):
            pass
        assert kv_pages_used(server) >= before + 300 // 16
        r = httpx.delete(f"{server.base}/v1/inferlets/runs/{run_id}", timeout=60)
        assert r.status_code == 200 and r.json()["cancelled"] is True
        rest = [line for line in lines if line]
    assert any("cancelled" in line for line in rest) and rest[-1] == "data: [DONE]"
    assert kv_pages_used(server) == before
    assert_error(httpx.delete(f"{server.base}/v1/inferlets/runs/{run_id}"), 404, "not_found_error")


def test_zz_sigterm_drains_and_leaves_no_child(server):
    """Last in the module: SIGTERM while a request streams; it finishes, the port closes, no child remains."""
    kids = children(server.proc.pid)
    assert kids, "the server has an engine and a host"
    body = {"model": TINY, "prompt": "Count:", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=300) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        os.kill(server.proc.pid, signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(x[6:]) for x in [first, *rest] if x != "data: [DONE]"]
    assert rest[-1] == "data: [DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=120) == 0
    assert not port_open(server.port)
    assert [p for p in kids if alive(p)] == []
