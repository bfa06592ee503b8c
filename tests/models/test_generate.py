"""Greedy decoding of the default model through the paged forward gives the known continuation."""

from __future__ import annotations

from tokenizers import Tokenizer


def test_capital_of_france(smollm, greedy):
    tok = Tokenizer.from_file(str(smollm.tokenizer_path))
    ids = tok.encode("The capital of France is").ids
    new = greedy(smollm.model, ids, 3)
    assert tok.decode(new).startswith(" Paris")
