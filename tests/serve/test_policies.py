"""Serving-level speculation policies: the command line's policy and a request's ``speculation`` mapped to
inferlets; a policy that cannot run stops `pie serve` before its port is bound; and greedy output over HTTP
under each method (a draft-model policy, per-request lookup and MTP) equals the output without speculation,
token for token, on the default model."""

from __future__ import annotations

import httpx
import pytest

from pie_runtime.serve.errors import APIError
from pie_runtime.serve.openai_api import JsonSchemaFormat, ResponseFormat, SpeculationRequest
from pie_runtime.serve.policies import (
    CONSTRAINED,
    INFERLETS,
    TEXT_COMPLETION,
    Capabilities,
    Policy,
    PolicyRefused,
    choose,
    parse_policy,
)
from pie_runtime.store import DEFAULT_MODEL
from tests.conftest import TINY
from tests.inferlets.conftest import SLICE, spec_home  # noqa: F401 - the fixture, shared with the inferlet tests
from tests.serve.server_proc import assert_refused_before_bind, start_serve

# ---- the command line's policy and the request's ---------------------------------------------------------------


def test_parse_policy():
    assert parse_policy(None, None, None) is None
    assert parse_policy("3:8", None, None) == Policy(method="lookup", ngram=3, k=8)
    assert parse_policy(None, "smol-slice:4", None) == Policy(method="draft", draft_model="smol-slice", k=4)
    assert parse_policy(None, None, "2") == Policy(method="mtp", k=2)
    for bad in [("3:8", "m:2", None), ("8", None, None), ("x:8", None, None), ("3:0", None, None), (None, None, "99")]:
        with pytest.raises(PolicyRefused):
            parse_policy(*bad)


def test_choose_the_inferlet():
    caps = Capabilities(mtp_depth=2, draft_model="d", draft_k=4)
    lookup = Policy(method="lookup", ngram=3, k=8)
    assert choose(None, Capabilities(), None, None) == (TEXT_COMPLETION, {})
    assert choose(lookup, caps, None, None) == (INFERLETS["lookup"], {"draft_length": 8, "max_ngram": 3})
    assert choose(lookup, caps, False, None) == (TEXT_COMPLETION, {})
    name, args = choose(None, caps, SpeculationRequest(method="mtp", k=2), None)
    assert (name, args) == (INFERLETS["mtp"], {"draft_length": 2})
    assert choose(None, caps, SpeculationRequest(method="draft", k=3), None) == (
        INFERLETS["draft"],
        {"draft": "d", "draft_length": 3},
    )
    for spec in (SpeculationRequest(method="mtp", k=3), SpeculationRequest(method="lookup", k=9)):
        with pytest.raises(APIError) as e:
            choose(lookup, caps, spec, None)
        assert e.value.status == 400 and (e.value.param or "").startswith("speculation")
    with pytest.raises(APIError):  # no draft model served
        choose(None, Capabilities(), SpeculationRequest(method="draft", k=1), None)
    name, args = choose(lookup, caps, None, ResponseFormat(type="json_object"))
    assert name == CONSTRAINED and args == {"json_schema": '{"type": "object"}'}
    schema = JsonSchemaFormat.model_validate({"name": "x", "schema": {"type": "integer"}})
    name, args = choose(None, caps, False, ResponseFormat(type="json_schema", json_schema=schema))
    assert name == CONSTRAINED and args["draft_length"] == 0
    with pytest.raises(APIError):
        bad = JsonSchemaFormat.model_validate({"name": "x", "schema": {"type": 12}})
        choose(None, caps, None, ResponseFormat(type="json_schema", json_schema=bad))


# ---- refusals before the listener binds ------------------------------------------------------------------------

REFUSALS = [
    ("no MTP head", TINY, ["--draft-mtp", "2"], "no MTP head"),
    ("draft with fewer positions", DEFAULT_MODEL, ["--draft-model", f"{TINY}:4"], "fewer than"),
    ("draft not in the store", TINY, ["--draft-model", "no-such-draft:4"], "no-such-draft"),
    ("K out of range", TINY, ["--draft-lookup", "3:999"], "K"),
    ("two policies", TINY, ["--draft-lookup", "3:4", "--draft-mtp", "2"], "not allowed with"),
]


@pytest.mark.e2e
@pytest.mark.parametrize(("model", "flags", "says"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_a_policy_that_cannot_run_stops_startup_before_binding(pie_home, model, flags, says):
    assert_refused_before_bind(pie_home, model, flags, says)


# ---- greedy output is the same under every method -----------------------------------------------------------

PROMPT = (
    "<|im_start|>user\nCopy this exactly: the cat sat on the mat, the cat sat on the mat, "
    "the dog sat on the log.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def policy_server(spec_home):  # noqa: F811 - the imported fixture
    """The default model with an MTP head attached, served with a draft-model policy (the slice model)."""
    s = start_serve(spec_home, DEFAULT_MODEL, "--kv-pages", "2048", "--draft-model", f"{SLICE}:3")
    yield s
    s.stop()


@pytest.mark.e2e
def test_greedy_output_is_the_same_under_every_method(policy_server):
    def tokens(speculation) -> tuple[list[int], dict | None]:
        body = {
            "model": DEFAULT_MODEL,
            "prompt": PROMPT,
            "max_tokens": 24,
            "temperature": 0,
            "speculation": speculation,
            "return_token_ids": True,
        }
        r = httpx.post(f"{policy_server.base}/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json().get("speculation")

    plain, none = tokens(False)
    assert plain and none is None
    for speculation in (None, {"method": "lookup", "k": 4}, {"method": "mtp", "k": 2}, {"method": "draft", "k": 2}):
        ids, spec = tokens(speculation)
        assert ids == plain, speculation
        assert spec is not None and spec["rounds"] > 0, speculation
    too_deep = httpx.post(
        f"{policy_server.base}/v1/completions",
        json={"model": DEFAULT_MODEL, "prompt": "x", "speculation": {"method": "draft", "k": 4}},
    )
    assert too_deep.status_code == 400 and too_deep.json()["error"]["param"] == "speculation.k"
