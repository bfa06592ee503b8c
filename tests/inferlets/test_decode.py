"""The shared decode helpers without an engine: output cutting and the fallback sampler."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from inferlet.args import DecodeArgs
from inferlet.output import Output
from inferlet.sampler import PlainSampler
from inferlet.tokenizer import Tokenizer
from pie_runtime.store import DEFAULT_MODEL, ModelStore


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    folder = ModelStore().path(DEFAULT_MODEL)
    cfg = json.loads((Path(folder) / "manifest.json").read_text())["config"]
    return Tokenizer((Path(folder) / "tokenizer.json").read_text(), cfg["eos_token_ids"], cfg["bos_token_id"], None)


def args(**kw) -> DecodeArgs:
    return DecodeArgs(prompt="x", stream=False, **kw)


def test_eos_inside_a_multi_token_result_cuts_there(tok):
    out = Output(tok, args(), prompt_len=5, max_positions=100)
    a, b = tok.encode(" one two")
    assert out.push([a, 2, b]) == 2
    assert out.ids == [a] and out.finish == "eos"


def test_max_tokens_inside_a_multi_token_result_cuts_there(tok):
    out = Output(tok, args(max_tokens=3), prompt_len=5, max_positions=100)
    ids = tok.encode(" one two three four five")
    assert out.push(ids[:2]) == 2 and not out.done
    assert out.push(ids[2:]) == 1
    assert out.ids == ids[:3] and out.finish == "length"


def test_capacity_cuts_like_text_completion(tok):
    out = Output(tok, args(max_tokens=50), prompt_len=97, max_positions=100)
    out.push(tok.encode(" one two three four five"))
    assert len(out.ids) == 3 and out.finish == "length"  # prompt + output reached 100 rows


def test_stop_string_inside_a_multi_token_result_cuts_there(tok):
    out = Output(tok, args(stop=["three"]), prompt_len=5, max_positions=100)
    ids = tok.encode(" one two three four five")
    out.push(ids)
    assert out.ids == ids[:3] and out.finish == "stop" and out.text() == " one two "


def test_fallback_reasons():
    assert args().fallback_reasons() == []
    assert args(repetition_penalty=1.2, logit_bias='{"5": 1.5}', logprobs=True).fallback_reasons() == [
        "penalties",
        "logit_bias",
        "logprobs",
    ]
    assert args(logprobs=True).logprobs == 0 and args(logit_bias='{"5": 1.5}').logit_bias == {5: 1.5}


def test_plain_sampler_penalties_and_bias():
    a = args(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=2.0, logit_bias={3: 10.0})
    s = PlainSampler(a, prompt=[1], rng=np.random.default_rng(0))
    logits = np.array([1.0, 4.0, -2.0, 0.0, 3.0])
    x = s.adjust(logits, generated=[4, 4, 2])
    # 1: prompt token → 4/2; 2: generated once → (-2 - 0.5 - 1) * 2; 3: bias; 4: (3 - 1 - 1) / 2
    assert np.allclose(x, [1.0, 2.0, -7.0, 10.0, 0.5])
    assert s.choose(logits, [4, 4, 2]) == 3
