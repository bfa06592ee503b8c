"""The request → run mapping without a server: prompt token counting bounded for huge prompts, the checks
``build_job`` makes before a run starts (empty prompt, context, unsupported fields, token-id prompts), and run
arguments that survive the control channel to a host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferlet.text.arguments import CompletionArgs
from inferlet.tokenizer import Tokenizer
from pie_runtime.serve import control as c
from pie_runtime.serve.errors import APIError
from pie_runtime.serve.generation import COUNT_PIECE, Limits, build_job, completion_prompt, count_tokens
from pie_runtime.serve.openai_api import CompletionRequest
from pie_runtime.serve.policies import Capabilities
from pie_runtime.store import DEFAULT_MODEL, ModelStore

LIMITS = Limits(max_model_len=512, page_size=16, max_n=4, max_tokens=64)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    folder = ModelStore().path(DEFAULT_MODEL)
    cfg = json.loads((Path(folder) / "manifest.json").read_text())["config"]
    return Tokenizer((Path(folder) / "tokenizer.json").read_text(), cfg["eos_token_ids"], cfg["bos_token_id"], None)


class Recording(Tokenizer):
    """The real tokenizer, remembering the length of every text it was asked to encode."""

    def __init__(self, tok: Tokenizer) -> None:
        super().__init__(tok.to_json(), tok.eos_token_ids, tok.bos_token_id, None)
        self.asked: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.asked.append(len(text))
        return super().encode(text)


def job(tok: Tokenizer, **body):
    req = CompletionRequest.model_validate({"model": "m", **body})
    return build_job(req, completion_prompt(tok, req), tok, LIMITS, None, Capabilities())


def refusal(tok: Tokenizer, **body) -> APIError:
    with pytest.raises(APIError) as e:
        job(tok, **body)
    assert e.value.status == 400
    return e.value


def test_a_huge_prompt_is_counted_past_the_limit_from_its_first_pieces(tok):
    rec = Recording(tok)
    text = "the quick brown fox jumps over the lazy dog. " * 70_000  # 3.1 MB
    n = count_tokens(rec, text, 8192)
    assert n > 8192
    assert max(rec.asked) <= COUNT_PIECE and sum(rec.asked) < 10 * COUNT_PIECE  # not all 3 MB


def test_a_prompt_that_fits_is_counted_exactly(tok):
    for text in ("", "hello", "word " * 5000, "x" * (3 * COUNT_PIECE)):
        assert count_tokens(tok, text, 100_000) == len(tok.encode(text))


def test_an_empty_prompt_is_the_clients_error(tok):
    for prompt in ("", [""]):
        err = refusal(tok, prompt=prompt)
        assert (err.param, err.code) == ("prompt", "empty_prompt")


def test_a_prompt_past_the_context_is_refused_before_tokenizing_all_of_it(tok):
    err = refusal(tok, prompt="hello " * 500_000)
    assert (err.param, err.code) == ("prompt", "context_length_exceeded")


def test_token_id_prompts_reach_the_inferlet_as_given(tok):
    spelled = [tok.encode(c)[0] for c in "hello"]  # "hello" encodes to fewer tokens
    for prompt in (spelled, [spelled]):
        j = job(tok, prompt=prompt, max_tokens=2)
        assert j.prompt_tokens == 5 and j.args["prompt"] == "hello"
        assert CompletionArgs.model_validate(j.args).prompt_ids(tok) == spelled


def test_the_runs_arguments_cross_the_control_channel(tok):
    """A host drops a message that does not decode (the run then waits for ever): a logit bias's token ids
    must travel as string keys and come out as the inferlet's ints."""
    j = job(tok, prompt="x", max_tokens=2, logit_bias={"17": 5.0}, stop=["a", "b"], seed=3)
    msg = c.decode_to_host(c.encode(c.StartRun(run="r", inferlet=j.inferlet, path="p.py", args=j.args)))
    assert isinstance(msg, c.StartRun)
    assert CompletionArgs.model_validate(msg.args).logit_bias == {17: 5.0}
    assert refusal(tok, prompt="x", logit_bias={str(tok.vocab_size): 1.0}).param == "logit_bias"


def test_echo_and_unsupported_fields(tok):
    assert job(tok, prompt="Once", echo=True).echo == "Once"
    assert refusal(tok, prompt="x", suffix="y").param == "suffix"
    assert refusal(tok, prompt="x", echo=True, logprobs=1).param == "echo"
