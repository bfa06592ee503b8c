"""KV editing through a real `pie serve --prompt-cache-dir DIR` (tiny model): a prompt cache saved by name
(``POST /v1/prompt_caches``) that completions and chats start from decode exactly what they decode without it,
with ``cached_tokens`` saying how much came from the file; names that are paths, unknown names and caches of
another model or format refused with typed errors; streaming-llm and prompt-cache run as custom inferlet runs;
and ``/metrics`` counts the evicted rows and the restored working sets exactly."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from inferlet.kv_file import SavedKV, write_saved
from pie_runtime.store import DEFAULT_MODEL, ModelStore
from tests.conftest import TINY
from tests.serve.server_proc import start_serve
from tests.serve.test_metrics import scrape, total

pytestmark = pytest.mark.e2e

SYSTEM = "You are a terse assistant who answers in one short sentence about the weather in small towns. " * 3
QUESTION = " Question: what is the weather like in Lund today? Answer:"


@pytest.fixture(scope="module")
def server(pie_home, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompt-caches")
    template = tmp_path_factory.mktemp("template") / "chat.jinja"  # the tiny model has none: ChatML
    template.write_text(ModelStore(pie_home / "models").get(DEFAULT_MODEL).tokenizer.chat_template or "")
    flags = ["--kv-pages", "256", "--pass-cost-rows", "0", "--chat-template", str(template)]
    s = start_serve(pie_home, TINY, *flags, "--prompt-cache-dir", str(folder))
    s.folder = folder  # type: ignore[attr-defined]
    yield s
    s.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base}{path}", json=body, timeout=300)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def refused(r: httpx.Response, status: int, code: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code, error
    return error


def complete(server, **kw) -> dict:
    body = {"model": TINY, "prompt": SYSTEM + QUESTION, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    return ok(post(server, "/v1/completions", {**body, "return_token_ids": True, **kw}))


def test_a_saved_prompt_starts_completions_and_chats_that_decode_as_without_it(server):
    card = ok(post(server, "/v1/prompt_caches", {"name": "system", "prompt": SYSTEM}))
    path = server.folder / "system.safetensors"
    assert card["id"] == "system" and card["bytes"] == path.stat().st_size and card["rows"] > 20
    assert [p.name for p in server.folder.iterdir()] == ["system.safetensors"]  # no scratch file left
    listed = ok(httpx.get(f"{server.base}/v1/prompt_caches"))["data"]
    assert [c["id"] for c in listed] == ["system"]
    plain = complete(server)
    cached = complete(server, prompt_cache="system")
    assert cached["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert cached["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    shared = cached["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert card["rows"] - 2 <= shared <= card["rows"]  # the file's rows but a word cut at the boundary
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ok(post(server, "/v1/prompt_caches", {"name": "chat-sys", "messages": messages[:1]}))
    chat = {"model": TINY, "messages": messages, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    want = ok(post(server, "/v1/chat/completions", chat))
    got = ok(post(server, "/v1/chat/completions", {**chat, "prompt_cache": "chat-sys"}))
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 20
    assert ok(httpx.delete(f"{server.base}/v1/prompt_caches/chat-sys"))["deleted"] is True
    refused(httpx.get(f"{server.base}/v1/prompt_caches/chat-sys"), 404, "prompt_cache_not_found")


def _foreign(folder, name: str, **meta: str) -> None:
    """A cache file as another model or format would have written it."""
    k = np.zeros((2, 1, 3, 4), dtype=np.float32)
    base = {"model": "other", "model_digest": "0" * 64, "weights": "fp32", "kv_dtype": "float32"}
    base |= {"committed": "3", "dropped": "0"}
    write_saved(folder / f"{name}.safetensors", SavedKV(k, k, [1, 2, 3], [4], [0, 1, 2], 0, {**base, **meta}))


def test_paths_unknown_names_and_foreign_caches_are_refused_typed(server):
    for name in ("../system", "/etc/passwd", "a/b", ".hidden", "a.b", ""):
        r = post(server, "/v1/completions", {"model": TINY, "prompt": "hi", "prompt_cache": name})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache", (name, r.text)
        r = post(server, "/v1/inferlets/prompt-cache/runs", {"args": {"load": name}})
        assert r.status_code == 400, (name, r.text)
    refused(httpx.delete(f"{server.base}/v1/prompt_caches/x.safetensors"), 400, "invalid_prompt_cache_name")
    r = httpx.delete(f"{server.base}/v1/prompt_caches/..%2F..%2Fx")
    assert r.status_code in (400, 404) and r.json()["error"]["code"] != "deleted"
    refused(
        post(server, "/v1/completions", {"model": TINY, "prompt": "hi", "prompt_cache": "nope"}),
        404,
        "prompt_cache_not_found",
    )
    refused(post(server, "/v1/prompt_caches", {"name": "../x", "prompt": "hi"}), 400, "invalid_value")
    _foreign(server.folder, "other-model")
    (server.folder / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    for name in ("other-model", "junk"):
        error = refused(
            post(server, "/v1/completions", {"model": TINY, "prompt": "hi", "prompt_cache": name}), 400, "kv_mismatch"
        )
        assert error["param"] == "prompt_cache" and error["type"] == "invalid_request_error"
        refused(post(server, "/v1/inferlets/prompt-cache/runs", {"args": {"load": name}}), 400, "kv_mismatch")
    refused(post(server, "/v1/inferlets/prompt-cache/runs", {"args": {"prompt": "hi", "save": "x"}}), 400, None)
    ok(post(server, "/v1/prompt_caches", {"name": "short", "prompt": SYSTEM}))
    r = post(server, "/v1/completions", {"model": TINY, "prompt": "hi", "prompt_cache": "short", "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_streaming_llm_and_prompt_cache_run_as_inferlets_and_metrics_count_their_edits(server):
    ok(post(server, "/v1/prompt_caches", {"name": "metrics", "prompt": SYSTEM}))
    before = scrape(server)
    args = {"prompt": SYSTEM, "max_tokens": 40, "ignore_eos": True, "sinks": 4, "window": 16, "chunk": 16}
    streamed = ok(post(server, "/v1/inferlets/streaming-llm/runs", {"args": args}))["result"]["stats"]
    loads = [
        ok(post(server, "/v1/inferlets/prompt-cache/runs", {"args": {"load": "metrics", "max_tokens": 4}})),
        ok(post(server, "/v1/inferlets/prompt-cache/runs", {"args": {"load": "metrics", "prompt": SYSTEM + "x"}})),
    ]
    complete(server, prompt_cache="metrics")
    after = scrape(server)

    def delta(name: str) -> float:
        return total(after, name, model=TINY) - total(before, name, model=TINY)

    assert streamed["evicted_rows"] > 0 and streamed["kv_pages"] <= (4 + 16 + 16) // 16 + 1
    assert delta("pie_kv_evicted_rows_total") == streamed["evicted_rows"]
    assert delta("pie_kv_evicted_pages_total") >= streamed["evictions"]  # each eviction freed a page at least
    assert delta("pie_kv_restored_working_sets_total") == len(loads) + 1
    rows = [r["result"]["stats"]["loaded_rows"] for r in loads]
    assert delta("pie_kv_restored_rows_total") == sum(rows) + rows[0]


def test_the_openapi_schema_documents_the_extension(server):
    schema = ok(httpx.get(f"{server.base}/openapi.json"))
    for request in ("CompletionRequest", "ChatRequest"):
        field = schema["components"]["schemas"][request]["properties"]["prompt_cache"]
        assert "prompt cache" in str(field) and "pattern" in str(field)
    assert {"get", "post"} <= set(schema["paths"]["/v1/prompt_caches"])
    assert {"get", "delete"} <= set(schema["paths"]["/v1/prompt_caches/{name}"])
