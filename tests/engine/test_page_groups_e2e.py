"""KV page groups through real engines (issue 56): a random Mistral of window 16 imported from a Hugging Face
folder, served with page groups (its layers keep only their window's pages) and with ``--kv-swa-full`` (every
row kept). Greedy decoding, plain and cacheback's (drafts rejected and accepted), gives the same tokens on both;
the decoding inferlets report ``kv_bytes`` / ``kv_bytes_max``, bounded by the window on the paged engine; the
engine's stats count pages per group; and every page is back after the inferlets' clients are gone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import home_with_checkpoint, run, start_engine

pytestmark = pytest.mark.e2e

NAME, WINDOW, PAGE = "tiny-mistral-swa", 16, 4
REPETITIVE = "one two three four five six. one two three four five six. one two three four five six. one two"


def write_tiny_mistral(folder: Path, tokenizer_json: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        sliding_window=WINDOW,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    transformers.MistralForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    shutil.copy(tokenizer_json, folder / "tokenizer.json")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    home = home_with_checkpoint(tmp_path_factory, "pie-home-swa", NAME, write_tiny_mistral)
    paged = start_engine(home, [NAME], "--page-size", str(PAGE))
    full = start_engine(home, [NAME], "--page-size", str(PAGE), "--kv-swa-full")
    yield paged, full
    paged.stop()
    full.stop()


def stats(address: str) -> dict:
    from tests.conftest import in_session

    async def body(model):
        return (await model.client.request("stats"))["models"][NAME]

    return in_session(address, body)


def test_greedy_decoding_equals_the_all_rows_engine_with_a_window_of_pages(engines):
    paged, full = engines
    words = ["--prompt", "The lighthouse keeper", "--max-tokens", "160", "--temperature", "0", "--ignore-eos"]
    a = run("text-completion", paged.address, *words)
    b = run("text-completion", full.address, *words)
    assert a["token_ids"] == b["token_ids"]
    sa, sb = a["stats"], b["stats"]
    assert sa["kv_pages_max"] <= WINDOW // PAGE + 2 + 4  # the window, its slack, and the prompt's prefill
    assert sb["kv_pages"] >= 160 // PAGE
    assert sa["kv_bytes"] < sb["kv_bytes"] and sa["kv_bytes_max"] <= sb["kv_bytes_max"]
    assert sa["kv_bytes"] == sa["kv_pages"] * (sb["kv_bytes"] // sb["kv_pages"])  # one group, pages alike
    cache = ["--prompt", REPETITIVE, "--max-tokens", "96", "--temperature", "0", "--ignore-eos"]
    plain = run("text-completion", paged.address, *cache)
    for eng in (paged, full):
        spec = run("cacheback-speculative-decoding", eng.address, *cache)
        assert spec["token_ids"] == plain["token_ids"]
    for eng in (paged, full):  # the inferlets' clients are gone: every page is back, every group empty
        s = stats(eng.address)
        assert s["pages_free"] == s["pages_total"]
        assert [g["pages"] for g in s["page_groups"]] == [0]
    assert stats(paged.address)["page_groups"][0]["window"] == WINDOW
    assert stats(full.address)["page_groups"][0]["window"] is None
