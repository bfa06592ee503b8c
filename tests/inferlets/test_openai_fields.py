"""OpenAI/vLLM request fields on the real default model, through text-completion and a speculative inferlet:
ignore_eos, stop_token_ids, logit_bias, penalties, logprobs/top_logprobs, n (forks after one prefill), seed,
and the result's shape (finish_reason, stop_reason, usage, speculation)."""

from __future__ import annotations

import asyncio
import contextlib
import io

import numpy as np
import pytest

import inferlet
from tests.inferlets.conftest import load

TC, CB = "text-completion", "cacheback-speculative-decoding"
EOS_PROMPT = {"prompt": "What is 2+2? Answer with just the number.", "chat": True}  # ends with EOS in a few tokens
STORY = {"prompt": "Once upon a time, there was a little girl named Emma who loved to play"}
REPETITIVE = {
    "prompt": "Repeat after me: the quick brown fox jumps over the lazy dog. "
    "The quick brown fox jumps over the lazy dog. The quick brown"
}
MAX = 12
EOS_IDS = [2]  # SmolLM2's <|im_end|>; checked against the model in test_result_shape

# Every run of this module, fired at once on one connection so the engine batches them (a few steps' wall
# time for all): name → (inferlet, args). Runs that need a reference's tokens come in a second batch.
RUNS: dict[str, tuple[str, dict]] = {
    "story": (TC, {**STORY, "max_tokens": MAX}),
    "eos": (TC, {**EOS_PROMPT, "max_tokens": MAX}),
    "repetitive": (TC, {**REPETITIVE, "max_tokens": MAX}),
    "ignore_eos": (TC, {**EOS_PROMPT, "max_tokens": MAX, "ignore_eos": True}),
    "ignore_eos_cb": (CB, {**EOS_PROMPT, "max_tokens": MAX, "ignore_eos": True}),
    "bias": (TC, {**STORY, "max_tokens": 4, "logit_bias": {"1171": 100.0}}),
    "bias_sampled": (TC, {**STORY, "max_tokens": 4, "logit_bias": {1171: 100.0}, "temperature": 0.9, "seed": 1}),
    "long": (TC, {**STORY, "max_tokens": 20}),
    "frequency": (TC, {**STORY, "max_tokens": 20, "frequency_penalty": 2.0}),
    "presence": (TC, {**STORY, "max_tokens": 20, "presence_penalty": 2.0}),
    "logprobs": (TC, {**STORY, "max_tokens": MAX, "logprobs": True, "top_logprobs": 5}),
    "sampled": (TC, {**STORY, "max_tokens": 8, "temperature": 0.8, "seed": 4}),
    "sampled_again": (TC, {**STORY, "max_tokens": 8, "temperature": 0.8, "seed": 4}),
    "sampled_seed5": (TC, {**STORY, "max_tokens": 8, "temperature": 0.8, "seed": 5}),
    "sampled_logprobs": (TC, {**STORY, "max_tokens": 8, "temperature": 0.8, "seed": 4, "logprobs": 5}),
    "logprobs_count": (TC, {**STORY, "max_tokens": 3, "logprobs": 2}),
    "n3": (TC, {**STORY, "max_tokens": MAX, "n": 3}),
    "n3_sampled": (TC, {**STORY, "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 5, "logprobs": True}),
    "n3_sampled_again": (TC, {**STORY, "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 5, "logprobs": True}),
    "n3_sampled_seed6": (TC, {**STORY, "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 6, "logprobs": True}),
    "stream_n2": (TC, {**STORY, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 3, "stream": True}),
    "cb_n2": (CB, {**REPETITIVE, "max_tokens": MAX, "n": 2, "draft_schedule": "fixed", "draft_length": 4}),
}


async def _fire(address: str, runs: dict[str, tuple[str, dict]]) -> dict[str, dict]:
    session = await inferlet.connect(address)
    try:
        mains = {name: load(name) for name, _ in runs.values()}
        calls = [mains[name][0](mains[name][1](**{"stream": False, **a})) for name, a in runs.values()]
        return dict(zip(runs, await asyncio.gather(*calls)))
    finally:
        session.client.close()


@pytest.fixture(scope="module")
def got(engine) -> dict[str, dict]:
    """The results of RUNS, then of the runs cut at a token of the story's greedy output (``stop_id``), and
    what the one streaming run printed (``streamed``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        res = asyncio.run(_fire(engine.address, RUNS))
    stop = res["story"]["token_ids"][5]
    cut = {"stop_token_ids": [stop, 49151], "max_tokens": MAX}
    res |= asyncio.run(_fire(engine.address, {"stop": (TC, {**STORY, **cut}), "stop_cb": (CB, {**STORY, **cut})}))
    res["stop_id"], res["streamed"] = {"id": stop}, {"text": out.getvalue()}
    return res


def test_result_shape(engine, got):
    res = got["story"]
    assert set(res) >= {"text", "token_ids", "finish_reason", "stop_reason", "stats"}
    assert "choices" not in res and "logprobs" not in res
    s = res["stats"]
    assert s["generated_tokens"] == len(res["token_ids"]) == MAX and res["finish_reason"] == "length"
    assert 0 <= s["cached_tokens"] <= s["prompt_tokens"]  # prompt rows the engine's prefix cache gave
    assert (got["eos"]["finish_reason"], got["eos"]["stop_reason"]) == ("stop", None)
    assert inferlet_eos(engine.address) == EOS_IDS


@pytest.mark.parametrize("key", ["ignore_eos", "ignore_eos_cb"])
def test_ignore_eos_runs_past_eos(got, key):
    want, res = got["eos"]["token_ids"], got[key]
    assert len(want) < MAX - 1
    assert res["token_ids"][: len(want)] == want and res["token_ids"][len(want)] in EOS_IDS
    assert (len(res["token_ids"]), res["finish_reason"]) == (MAX, "length")
    assert res["text"].startswith(got["eos"]["text"] + "<|im_end|>")


@pytest.mark.parametrize("key", ["stop", "stop_cb"])
def test_stop_token_ids_cut(got, key):
    want, stop, res = got["story"]["token_ids"], got["stop_id"]["id"], got[key]
    assert res["token_ids"] == want[: want.index(stop)]
    assert (res["finish_reason"], res["stop_reason"]) == ("stop", stop)
    assert got["story"]["text"].startswith(res["text"])


def test_logit_bias_forces_a_token(got):
    assert got["bias"]["token_ids"] == got["bias_sampled"]["token_ids"] == [1171] * 4


@pytest.mark.parametrize("key", ["frequency", "presence"])
def test_penalties_change_the_output(got, key):
    want, res = got["long"]["token_ids"], got[key]["token_ids"]
    assert res != want and len(res) == len(want)
    first = next(i for i, (a, b) in enumerate(zip(want, res)) if a != b)
    assert want[first] in want[:first]  # the greedy token there had been generated already: it was penalised


@pytest.mark.parametrize("key,plain", [("logprobs", "story"), ("sampled_logprobs", "sampled")])
def test_logprobs_are_the_readout_probabilities(engine, got, key, plain):
    res = got[key]
    assert res["token_ids"] == got[plain]["token_ids"]  # asking for logprobs changes no token
    entries = res["logprobs"]
    assert [e["token_id"] for e in entries] == res["token_ids"]
    for e in entries:
        tops = [lp for _, lp in e["top"]]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and e["logprob"] <= tops[0]
        if key == "logprobs":  # greedy: the chosen token is the top one
            assert e["top"][0][0] == e["token_id"]
    probs = asyncio.run(_readout_probs(engine.address, STORY["prompt"], res["token_ids"]))
    chosen = probs[np.arange(len(entries)), res["token_ids"]]
    assert np.exp([e["logprob"] for e in entries]) == pytest.approx(chosen, rel=1e-4, abs=1e-6)
    top_ids = [t for t, _ in entries[0]["top"]]
    assert np.exp([lp for _, lp in entries[0]["top"]]) == pytest.approx(probs[0][top_ids], rel=1e-4, abs=1e-6)


def test_logprobs_with_a_count_alone(got):
    assert [len(e["top"]) for e in got["logprobs_count"]["logprobs"]] == [2, 2, 2]


def test_seed_reproduces_a_sampled_run(got):
    assert got["sampled"]["token_ids"] == got["sampled_again"]["token_ids"] != got["sampled_seed5"]["token_ids"]


def test_n_greedy_gives_identical_choices(got):
    want, res = got["story"], got["n3"]
    assert len(res["choices"]) == 3
    assert all(c["token_ids"] == want["token_ids"] and c["text"] == want["text"] for c in res["choices"])
    assert res["token_ids"] == want["token_ids"] and res["stats"]["generated_tokens"] == 3 * MAX
    assert res["stats"]["prompt_tokens"] == want["stats"]["prompt_tokens"]


def test_n_sampled_choices_differ_and_a_seed_reproduces_them(got):
    choices = [c["token_ids"] for c in got["n3_sampled"]["choices"]]
    assert len({tuple(c) for c in choices}) > 1
    assert choices == [c["token_ids"] for c in got["n3_sampled_again"]["choices"]]
    assert choices != [c["token_ids"] for c in got["n3_sampled_seed6"]["choices"]]
    assert all([e["token_id"] for e in c["logprobs"]] == c["token_ids"] for c in got["n3_sampled"]["choices"])


def test_streaming_with_n_emits_choice_zero(got):
    choices = got["stream_n2"]["choices"]
    assert got["streamed"]["text"] == choices[0]["text"] != choices[1]["text"]


def test_speculative_n_keeps_the_greedy_output_and_sums_its_stats(got):
    want, res = got["repetitive"]["token_ids"], got["cb_n2"]
    assert [c["token_ids"] for c in res["choices"]] == [want, want] and res["token_ids"] == want
    spec = res["speculation"]
    assert spec["proposed"] > 0 and spec["accepted"] > 0 and spec["acceptance"] == spec["accepted"] / spec["proposed"]
    assert len(spec["per_position"]) == len(spec["proposed_per_position"]) > 0
    assert res["stats"]["proposed"] == spec["proposed"] and res["stats"]["generated_tokens"] == 2 * MAX


def inferlet_eos(address: str) -> list[int]:
    async def go() -> list[int]:
        session = await inferlet.connect(address)
        try:
            return inferlet.model().eos_token_ids
        finally:
            session.client.close()

    return asyncio.run(go())


async def _readout_probs(address: str, prompt: str, generated: list[int]) -> np.ndarray:
    """The engine's Distribution (temperature 1) at each row that picked a generated token."""
    session = await inferlet.connect(address)
    try:
        m = inferlet.model()
        ids = m.tokenizer.encode(prompt) + generated[:-1]
        ws = m.working_set()
        rows = range(len(ids) - len(generated), len(ids))
        res = await inferlet.ForwardPass(ws).embed(ids).readout(rows, inferlet.Distribution(1.0)).submit()
        await ws.release()
        assert res.probs is not None
        return res.probs.astype(np.float64)
    finally:
        session.client.close()
