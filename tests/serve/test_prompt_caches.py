"""The prompt-cache folder of `pie serve` (serve/prompt_caches.py), without a server: names are names (anything
path-like is a 400 before the folder is touched), a file is checked against the served model from its header
(another model's digest, weight format or KV dtype, or no saved working set at all: 400 ``kv_mismatch``), saves
land atomically and scratch files are never listed, and a request that asks for what the prompt-cache inferlet
cannot do with a cache is a 400 naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from inferlet.kv_file import SavedKV, read_meta, write_saved
from pie_runtime.protocol.messages import ModelInfo
from pie_runtime.serve.errors import APIError
from pie_runtime.serve.generation import Job
from pie_runtime.serve.openai_api import CompletionRequest
from pie_runtime.serve.prompt_caches import PROMPT_CACHE, PromptCaches, start_from

INFO = ModelInfo(
    name="m",
    vocab_size=10,
    max_positions=64,
    page_size=16,
    bos_token_id=None,
    eos_token_ids=[],
    chat_template=None,
    weights="int4",
    weights_digest="a" * 64,
    kv_dtype="bfloat16",
)


def save(path, **meta: str) -> None:
    k = np.zeros((1, 1, 2, 4), dtype=np.uint16)  # bfloat16's bits
    base = {"model": "m", "model_digest": "a" * 64, "weights": "int4", "kv_dtype": "bfloat16"}
    base |= {"committed": "2", "dropped": "0", **meta}
    write_saved(path, SavedKV(k, k, [1, 2], [3], [0, 1], 0, base))


def refusal(call) -> APIError:
    with pytest.raises(APIError) as e:
        call()
    return e.value


@pytest.mark.parametrize("name", ["../x", "..", "/etc/passwd", "a/b", ".hidden", "x.safetensors", "", "a b", "é"])
def test_a_name_that_is_no_plain_name_is_a_400(tmp_path, name):
    caches = PromptCaches(tmp_path)
    err = refusal(lambda: caches.path(name, "prompt_cache"))
    assert (err.status, err.code, err.param) == (400, "invalid_prompt_cache_name", "prompt_cache")


def test_a_file_is_checked_against_the_model_from_its_header(tmp_path):
    caches = PromptCaches(tmp_path)
    save(tmp_path / "good.safetensors")
    assert caches.checked("good", INFO, "prompt_cache") == tmp_path / "good.safetensors"
    save(tmp_path / "other.safetensors", model_digest="b" * 64)
    save(tmp_path / "fp32.safetensors", weights="fp32")
    save(tmp_path / "f32kv.safetensors", kv_dtype="float32")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    for name in ("other", "fp32", "f32kv", "junk"):
        err = refusal(lambda name=name: caches.checked(name, INFO, "prompt_cache"))
        assert (err.status, err.code) == (400, "kv_mismatch"), name
    err = refusal(lambda: caches.checked("absent", INFO, "prompt_cache"))
    assert (err.status, err.code) == (404, "prompt_cache_not_found")
    assert read_meta(tmp_path / "good.safetensors")["committed"] == "2"


def test_a_save_lands_whole_and_scratch_files_are_not_caches(tmp_path):
    caches = PromptCaches(tmp_path)
    scratch = caches.scratch()
    save(scratch)
    assert caches.names() == []  # a save in progress is no cache
    caches.commit(scratch, "done")
    assert caches.names() == ["done"] and not scratch.exists()
    card = caches.card("done")
    assert (card.id, card.rows, card.bytes, card.weights) == (
        "done",
        2,
        (tmp_path / "done.safetensors").stat().st_size,
        "int4",
    )


def test_start_from_runs_prompt_cache_and_refuses_what_it_cannot_do(tmp_path):
    job = Job("cacheback-speculative-decoding", {"prompt": "p", "draft_length": 4, "max_ngram": 3}, 3, 8, 1)
    base: dict = {"model": "m", "prompt": "p", "prompt_cache": "c"}
    got = start_from(job, CompletionRequest.model_validate(base), tmp_path / "c.safetensors")
    assert got.inferlet == PROMPT_CACHE and got.args == {"prompt": "p", "load": str(tmp_path / "c.safetensors")}
    for extra, param in (
        ({"n": 2}, "n"),
        ({"speculation": {"method": "lookup", "k": 2}}, "speculation"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ):
        err = refusal(
            lambda extra=extra: start_from(job, CompletionRequest.model_validate(base | extra), tmp_path / "c")
        )
        assert (err.status, err.param) == (400, param)
