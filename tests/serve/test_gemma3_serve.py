"""Gemma 3 270M end to end behind one `pie serve` (the store's alias import, its default format): on a prompt
past the sliding layers' 512-row window, cacheback's greedy tokens equal text-completion's and streaming-llm runs
(its sinks kept by streaming the prompt, so the sliding layers never let them go) with flat KV; the `openai`
client's completion, plain and streamed, is text-completion's text; the base model has no chat template, so a
chat completion is a 400 that says so."""

from __future__ import annotations

import httpx
import openai
import pytest

from pie_runtime.distill.data import find_corpus
from pie_runtime.store import ModelStore, import_model
from tests.serve.server_proc import start_serve

pytestmark = pytest.mark.e2e

MODEL = "gemma3-270m"
WINDOW = 512  # the sliding layers' window
NEW = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("gemma-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIE_HOME", str(home))
        import_model(MODEL, store=ModelStore(home / "models"), progress=False)
    s = start_serve(home, MODEL, "--pass-cost-rows", "0", "--kv-memory", "256")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def prompt() -> str:
    corpus = find_corpus()
    if corpus is None:
        pytest.skip("no corpus: set PIE_CORPUS_DIR to a folder with austen.txt")
    return corpus.read_text()[20_000:23_600]  # about 830 tokens


def run(server, name: str, **args) -> dict:
    r = httpx.post(f"{server.base}/v1/inferlets/{name}/runs", json={"args": args}, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["result"]


@pytest.fixture(scope="module")
def plain(server, prompt) -> dict:
    got = run(server, "text-completion", prompt=prompt, max_tokens=NEW, ignore_eos=True)
    assert got["stats"]["prompt_tokens"] > WINDOW + 100 and len(got["token_ids"]) == NEW
    return got


def test_cacheback_decodes_text_completions_tokens_past_the_window(server, prompt, plain):
    got = run(server, "cacheback-speculative-decoding", prompt=prompt, max_tokens=NEW, ignore_eos=True)
    assert got["token_ids"] == plain["token_ids"]


def test_streaming_llm_keeps_its_sinks_past_the_window_and_its_pages_flat(server, prompt, plain):
    """Prefilled whole, the prompt would have let the sliding layers drop the sinks that the compacted window
    attends again: the engine refused the first eviction (`unsupported`)."""
    sinks, window, chunk = 4, 60, 16
    got = run(server, "streaming-llm", prompt=prompt, max_tokens=NEW, ignore_eos=True, sinks=sinks, window=window)
    s = got["stats"]
    assert len(got["token_ids"]) == NEW and s["evictions"] > 0
    assert s["kv_rows"] < sinks + window + chunk
    assert s["kv_rows"] + s["evicted_rows"] == s["prompt_tokens"] + NEW - 1
    assert s["kv_pages_max"] < plain["stats"]["kv_pages_max"] // 4


def test_the_openai_client_completes_as_text_completion_does(server, prompt, plain):
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", timeout=600)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW, "temperature": 0}
    extra = {"ignore_eos": True}
    done = client.completions.create(**body, extra_body=extra)
    assert done.choices[0].text == plain["text"]
    streamed = client.completions.create(**body, stream=True, extra_body=extra)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain["text"]


def test_a_chat_completion_on_the_base_model_is_a_clear_400(server):
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", timeout=600)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
    assert "chat template" in str(refused.value)
