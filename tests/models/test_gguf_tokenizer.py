"""Tokenizers rebuilt from GGUF vocabularies give llama.cpp's own ids, exactly: the default model's (byte-level
BPE, pre-tokenizer smollm), the same vocabulary under the llama-bpe, qwen2, gpt-2 and default split rules,
Gemma 3's SentencePiece, and SentencePiece with add_space_prefix. The golden ids come from llama.cpp through
llama-cpp-python (examples/gguf_tokenizer_fixtures.py writes tests/models/fixtures/gguf_tokenizer.json); where
the bench's llama-cpp-python is built, the last test asks llama.cpp again. Unsupported tokenizers are refused
before any tensor is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from pie_runtime.models.config import UnsupportedModelError
from pie_runtime.models.gguf_tokenizer import check_tokenizer
from tests.models.gguf_vocabs import FIXTURE, VOCABS, built, fx, sdk_tokenizer


def once_bos(ids: list[int], bos: int | None) -> list[int]:
    """llama.cpp's prompt ids without the second BOS it adds to a text that starts with the BOS text (it warns;
    the SDK adds none then)."""
    return ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids


@pytest.mark.parametrize("name", list(FIXTURE))
def test_ids_equal_llama_cpp(name):
    tok, meta = sdk_tokenizer(name)
    entry = FIXTURE[name]
    assert entry["tokens_sha256"] == fx.tokens_digest(meta), "the installed vocabulary is not the fixture's"
    assert [c["text"] for c in entry["cases"]] == [*fx.TEXTS, *fx.random_texts()]
    for case in entry["cases"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.encode_prompt(case["text"]) == once_bos(case["prompt_ids"], tok.bos_token_id), case["text"]


def test_each_split_rule_is_told_apart_by_the_fixture():
    """The held-out texts give different ids under every pair of pre-tokenizers (a wrong rule would show)."""
    names = ["smollm", *fx.BPE_VARIANTS]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            differ = sum(x["ids"] != y["ids"] for x, y in zip(FIXTURE[a]["cases"], FIXTURE[b]["cases"]))
            assert differ >= 3, (a, b)


@pytest.mark.parametrize(
    ("name", "bos", "eos", "add_bos"),
    [("smollm", 1, [2], False), ("llama-bpe", 1, [2], True), ("gemma3", 2, [1, 106], True)],
)
def test_bos_eos_and_add_bos_from_the_gguf(name, bos, eos, add_bos):
    """SmolLM2 says add_bos_token false; a Llama 3 (llama-bpe) GGUF without the key gets llama.cpp's default,
    true; Gemma says true, and its <end_of_turn> also ends generation, as in llama.cpp."""
    tok, _ = sdk_tokenizer(name)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token) == (bos, eos, add_bos)


def test_round_trips_through_decode():
    for name in ("smollm", "gemma3"):
        tok, _ = sdk_tokenizer(name)
        for text in fx.TEXTS:
            assert tok.decode(tok.encode(text)) == text, (name, text)


def _refusal(meta_change: dict) -> str:
    meta = dict(fx.read_meta(str(fx.smollm_gguf())))
    meta.update(meta_change)
    with pytest.raises(UnsupportedModelError) as e:
        check_tokenizer(meta)
    return str(e.value)


def test_unsupported_tokenizers_are_refused_naming_the_supported():
    supported = "supported: tokenizer models gpt2 (byte-level BPE), llama (SentencePiece); gpt2 pre-tokenizers"
    message = _refusal({"tokenizer.ggml.model": "bert"})
    assert "unsupported GGUF tokenizer model 'bert'" in message and supported in message
    message = _refusal({"tokenizer.ggml.pre": "deepseek-coder"})
    assert "unsupported GGUF pre-tokenizer 'deepseek-coder'" in message
    assert "llama-bpe, qwen2, smollm, gpt-2, default" in message


def test_an_unsupported_tokenizer_is_refused_before_any_tensor_is_read(tmp_path, monkeypatch):
    """A GGUF of a supported architecture whose tokenizer is not: refused before a tensor is dequantized."""
    import gguf
    import numpy as np

    from pie_runtime.models import gguf_import
    from pie_runtime.models.gguf_meta import read_gguf

    meta = dict(fx.read_meta(str(fx.smollm_gguf())))
    meta["tokenizer.ggml.pre"] = "deepseek-coder"
    path = fx.write_variant(meta, tmp_path / "refused.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "with-tensor.gguf"), "llama")  # the same keys and one tensor
    source = read_gguf(path)
    for key, value in source.fields.items():
        if key.startswith(("llama.", "tokenizer.")):
            types = source.types[key]
            w.add_key_value(key, value, types[0], types[-1] if len(types) > 1 else None)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    def no_tensor_reads(*args, **kwargs):
        raise AssertionError("a tensor was read before the tokenizer was checked")

    monkeypatch.setattr(gguf.quants, "dequantize", no_tensor_reads)
    monkeypatch.setattr(gguf_import, "check_shapes", no_tensor_reads)
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF pre-tokenizer 'deepseek-coder'"):
        gguf_import.convert_gguf(tmp_path / "with-tensor.gguf", progress=False)


def _llama_cpp_python() -> Path | None:
    from pie_runtime.bench.llama_cpp_env import _importable, venv_python

    python = venv_python()
    return python if _importable(python) else None


def test_live_against_llama_cpp(tmp_path):
    """llama.cpp asked now (not the fixture) on every vocabulary installed here, the same texts."""
    python = _llama_cpp_python()
    if python is None:
        pytest.skip(
            "llama-cpp-python is not built here (`pie bench decode` or examples/gguf_tokenizer_fixtures.py builds it)"
        )
    for name, vocab in VOCABS.items():
        live = fx.llama_cases(python, vocab, tmp_path)
        tok, _ = built(name)
        for case in live["cases"]:
            assert tok.encode(case["text"]) == case["ids"], (name, case["text"])
            assert tok.encode_prompt(case["text"]) == once_bos(case["prompt_ids"], tok.bos_token_id), (
                name,
                case["text"],
            )
