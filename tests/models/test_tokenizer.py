"""The tokenizer.json rebuilt from the GGUF: lossless round trips, digits split one by one, special tokens
as single ids, and the manifest's chat template rendering with jinja2."""

from __future__ import annotations

import jinja2
import pytest
from tokenizers import Tokenizer


@pytest.fixture(scope="module")
def tok(smollm) -> Tokenizer:
    return Tokenizer.from_file(str(smollm.tokenizer_path))


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! It costs $12,345.67 in 2024.",
        "naïve café — 日本語のテキスト, emoji 🎉🚀, tabs\tand\nnewlines  double  spaces",
        "<|im_start|>user\nHi there<|im_end|>\n",
        "    def f(x):\n        return x ** 2  # code\n",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode("12345").ids
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")


def test_special_tokens_are_single_ids(tok, smollm):
    info = smollm.manifest.tokenizer
    assert "<|im_start|>" in info.special_tokens and "<|im_end|>" in info.special_tokens
    assert tok.encode("<|im_start|>").ids == [tok.token_to_id("<|im_start|>")] == [1]
    assert tok.encode("<|im_end|>").ids == [2]
    assert info.bos_token_id == 1 and info.eos_token_ids == [2]
    assert tok.encode("hello").ids[0] != info.bos_token_id  # add_bos_token is false for SmolLM2


def test_chat_template_renders(tok, smollm):
    template = smollm.manifest.tokenizer.chat_template
    assert template
    env = jinja2.Environment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(template).render(
        messages=[{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text).ids
    assert ids.count(1) == 3  # system (default), user, assistant
