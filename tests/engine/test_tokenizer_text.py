"""The engine keeps its tokenizer.json as ASCII text (engine/tokenizer_text.py): the same JSON value, whatever
the chunk boundaries cut through."""

from __future__ import annotations

import json

import pytest

from pie_runtime.engine.tokenizer_text import ascii_json_text

DOC = {
    "model": {"vocab": {"hé": 0, "日本語": 1, "😀": 2, "𝔘x": 3, 'q"\\': 4, "\u2581the": 5}},
    "added_tokens": [{"content": "<start_of_turn>", "id": 6}, {"content": "∑\n", "id": 7}],
}


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 1 << 20])  # small chunks split multi-byte characters
def test_the_text_is_ascii_and_the_same_json(tmp_path, chunk):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(DOC, ensure_ascii=False, indent=1), encoding="utf-8")
    text = ascii_json_text(path, chunk)
    assert text.isascii()
    assert json.loads(text) == DOC
    assert "\\ud83d\\ude00" in text  # beyond the BMP: a surrogate pair, as JSON writes it


def test_the_default_models_tokenizer_reads_the_same(tmp_path):
    from tokenizers import Tokenizer

    from pie_runtime.store import ModelStore

    store = ModelStore()
    if not store.exists("smollm2-135m"):
        pytest.skip("the default model is not imported here")
    path = store.path("smollm2-135m") / "tokenizer.json"
    ours, theirs = Tokenizer.from_str(ascii_json_text(path)), Tokenizer.from_file(str(path))
    text = "Héllo wörld 😀 日本語 <|im_start|>user"
    assert ours.encode(text).ids == theirs.encode(text).ids
    assert ours.get_vocab() == theirs.get_vocab()
