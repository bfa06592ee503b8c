"""The shared decode helpers without an engine: output cutting, the request fields' validation, the samplers
and the merging of n choices."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from inferlet.sampler import PlainSampler
from inferlet.spec.stats import SpecStats
from inferlet.spec.verify import VerifyResult
from inferlet.text.arguments import DecodeArgs
from inferlet.text.choices import merge_choices
from inferlet.text.output import Output
from inferlet.tokenizer import Tokenizer
from pie_runtime.store import DEFAULT_MODEL, ModelStore


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    folder = ModelStore().path(DEFAULT_MODEL)
    cfg = json.loads((Path(folder) / "manifest.json").read_text())["config"]
    return Tokenizer((Path(folder) / "tokenizer.json").read_text(), cfg["eos_token_ids"], cfg["bos_token_id"], None)


def args(**kw) -> DecodeArgs:
    return DecodeArgs(**{"prompt": "x", "stream": False, **kw})


def test_eos_inside_a_multi_token_result_cuts_there(tok):
    out = Output(tok, args(), prompt_len=5, max_positions=100)
    a, b = tok.encode(" one two")
    assert out.push([a, 2, b]) == 2
    assert out.ids == [a] and (out.finish, out.stop_reason) == ("stop", None)


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


def test_stop_token_ids_cut_like_eos_and_say_which(tok):
    a, b, c = tok.encode(" one two three")
    out = Output(tok, args(stop_token_ids=[b]), prompt_len=5, max_positions=100)
    assert out.push([a, b, c]) == 2
    assert out.ids == [a] and (out.finish, out.stop_reason) == ("stop", b)
    assert out.result() == {"text": " one", "token_ids": [a], "finish_reason": "stop", "stop_reason": b}


def test_ignore_eos_keeps_eos_as_a_token(tok):
    eos = tok.eos_token_ids[0]
    out = Output(tok, args(ignore_eos=True, max_tokens=3), prompt_len=5, max_positions=100)
    assert out.push([eos, eos, eos]) == 3
    assert out.ids == [eos] * 3 and out.finish == "length"


def test_stop_string_names_the_string_that_stopped(tok):
    out = Output(tok, args(stop=["four", "two"]), prompt_len=5, max_positions=100)
    out.push(tok.encode(" one two three four"))
    assert (out.finish, out.stop_reason, out.text()) == ("stop", "two", " one ")


def test_logprobs_and_top_logprobs_follow_openai():
    assert args().top_count is None
    assert args(logprobs=True).top_count == 0  # chat: logprobs=true
    assert args(logprobs=True, top_logprobs=4).top_count == 4  # chat: with top_logprobs
    assert args(logprobs=3).top_count == 3  # completions: logprobs=3
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        args(top_logprobs=2)
    assert args(top_logprobs=0).top_count is None
    for bad in ({"logprobs": 21}, {"logit_bias": {5: 101.0}}, {"n": 0}, {"presence_penalty": 2.5}):
        with pytest.raises(ValueError):
            args(**bad)


def test_choice_args_keep_choice_zero_and_derive_reproducible_seeds():
    a = args(n=3, seed=7, stream=True)
    assert a.for_choice(0) is a
    seeds = [a.for_choice(i).seed for i in range(3)]
    assert seeds[0] == 7 and len(set(seeds)) == 3 and seeds == [a.for_choice(i).seed for i in range(3)]
    assert not a.for_choice(1).stream and a.for_choice(1).n == 3
    assert args(n=2).for_choice(1).seed is None
    assert args(seed=-1).seed == 2**63 - 1 and args(seed=-1, n=2).for_choice(1).seed is not None


def test_plain_sampler_logprobs_entry_sorted_and_normalized():
    s = PlainSampler(args(logprobs=True, top_logprobs=3), prompt=[1], rng=np.random.default_rng(0))
    logits = np.array([0.5, 2.0, 2.0, -1.0, 1.0])
    assert s.choose(logits, []) == 1
    (entry,) = s.logprobs
    want = logits - np.log(np.exp(logits).sum())
    assert entry["token_id"] == 1 and entry["logprob"] == pytest.approx(want[1])
    assert [t for t, _ in entry["top"]] == [1, 2, 4]  # sorted by logprob, ties to the lower id
    assert [lp for _, lp in entry["top"]] == pytest.approx(sorted(want, reverse=True)[:3])


def test_logit_bias_outside_the_vocabulary_is_refused():
    s = PlainSampler(args(logit_bias={9: 1.0}), prompt=[1], rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.choose(np.zeros(5), [])


def test_merge_choices_sums_usage_and_speculation():
    def one(tokens: list[int], accepted: int) -> dict:
        st = SpecStats()
        st.record(VerifyResult(tokens=[0] * (accepted + 1), accepted=accepted, proposed=2))
        st.skip("no_draft")
        stats = {"prompt_tokens": 9, "generated_tokens": len(tokens), "cached_tokens": 4}
        stats |= {"prefill_ms": 3.0, "decode_tokens_per_s": 10.0}
        fields = {"text": "t", "token_ids": tokens, "finish_reason": "length", "stop_reason": None}
        return fields | {"stats": stats, "speculation": st.summary()}

    merged = merge_choices([one([1, 2], 2), one([3], 0)], shared_prefill_ms=5.0)
    assert merged["token_ids"] == [1, 2] and [c["token_ids"] for c in merged["choices"]] == [[1, 2], [3]]
    assert set(merged["choices"][0]) == {"text", "token_ids", "finish_reason", "stop_reason"}
    s = merged["stats"]
    assert (s["prompt_tokens"], s["cached_tokens"], s["generated_tokens"]) == (9, 4, 3)
    assert (s["prefill_ms"], s["decode_tokens_per_s"]) == (8.0, 20.0)
    spec = merged["speculation"]
    assert (spec["rounds"], spec["proposed"], spec["accepted"], spec["skipped"]) == (2, 4, 2, {"no_draft": 2})
    assert spec["per_position"] == [0.5, 0.5] and spec["acceptance"] == 0.5
