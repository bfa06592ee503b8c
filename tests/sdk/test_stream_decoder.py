"""The incremental detokenizer (``inferlet.tokenizer.StreamDecoder``) on the default model's real tokenizer:
its deltas join up to decoding the whole sequence after every push, multi-byte UTF-8 split across tokens
included, and a stop string that a delta completes is found where it starts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from inferlet.text.arguments import DecodeArgs
from inferlet.text.output import Output
from inferlet.tokenizer import StreamDecoder, Tokenizer
from pie_runtime.store import DEFAULT_MODEL, ModelStore

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "naïve café — déjà vu; Größe 😀🎉 中文字符 日本語のテキスト 한국어",
    "  leading spaces\n\nand\ttabs   and a 🧑‍🚀 (a joined emoji) then ∑ x² ≤ ∞",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    folder = ModelStore().path(DEFAULT_MODEL)
    cfg = json.loads((Path(folder) / "manifest.json").read_text())["config"]
    return Tokenizer((Path(folder) / "tokenizer.json").read_text(), cfg["eos_token_ids"], cfg["bos_token_id"], None)


def check_pushes(tok: Tokenizer, ids: list[int], sizes: list[int]) -> None:
    """Pushes ``ids`` in pieces of ``sizes``; after each, the joined deltas are the whole decode (less a
    character whose bytes have not all come)."""
    dec = StreamDecoder(tok)
    joined, at = "", 0
    for size in sizes:
        joined += dec.push(ids[at : at + size])
        at += size
        whole = tok.decode(ids[:at])
        if not whole.endswith("\ufffd"):
            assert joined == whole
        else:
            assert whole.startswith(joined)
        assert dec.text == joined


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_whole_decode_one_token_a_push(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    check_pushes(tok, ids, [1] * len(ids))


def test_a_character_split_across_tokens_comes_whole_once_its_last_byte_does(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # byte-level BPE: the emoji's four bytes take more than one token here
    dec = StreamDecoder(tok)
    assert [dec.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.push(ids[-1:]) == "😀"


def test_random_tokens_and_random_push_sizes(tok):
    rng = random.Random(7)
    byte_heavy = [i for t in TEXTS for i in tok.encode(t)]
    for _ in range(30):
        n = rng.randint(1, 60)
        ids = [rng.choice(byte_heavy) if rng.random() < 0.7 else rng.randrange(tok.vocab_size) for _ in range(n)]
        sizes = []
        while sum(sizes) < n:
            sizes.append(rng.randint(1, 4))
        check_pushes(tok, ids, sizes)


def test_a_long_output_decodes_only_a_window_a_push(tok):
    ids = tok.encode(" and so on" * 400)
    calls: list[int] = []
    real = tok.decode

    def counting(seq, skip_special_tokens=False):
        calls.append(len(seq))
        return real(seq, skip_special_tokens)

    tok.decode = counting  # type: ignore[method-assign]
    try:
        dec = StreamDecoder(tok)
        for i in ids:
            dec.push([i])
    finally:
        del tok.decode
    assert dec.text == real(ids)
    assert max(calls) <= 4  # the window, never the whole output


@pytest.mark.parametrize(
    ("stop", "reason", "text"),
    [(["fox"], "fox", "The quick brown "), (["fox", "quick"], "quick", "The "), (["ö"], "ö", "Gr")],
)
def test_a_stop_string_is_found_where_it_starts(tok, stop, reason, text):
    ids = tok.encode("The quick brown fox jumps" if "ö" not in stop else "Größe")
    out = Output(tok, DecodeArgs(prompt="x", stream=False, stop=stop), prompt_len=5, max_positions=1000)
    for i in ids:
        out.push([i])
        if out.done:
            break
    assert (out.finish, out.stop_reason, out.text()) == ("stop", reason, text)
