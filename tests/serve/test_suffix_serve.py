"""`pie serve --draft-suffix K[:ROWS] [--suffix-index FILE]`: the policy parsed and mapped to
suffix-speculative-decoding's arguments; a bad index file refused before the listener binds; and on a real
server (the default model) greedy text equal to the text without speculation, a repeated and a similar request
drafting from the earlier outputs the host's shared store keeps, and the static index's documents reaching it.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from pie_runtime.serve.openai_api import SpeculationRequest
from pie_runtime.serve.policies import INFERLETS, Capabilities, Policy, PolicyRefused, choose, parse_policy
from pie_runtime.store import DEFAULT_MODEL, ModelStore
from tests.conftest import TINY
from tests.serve.server_proc import assert_refused_before_bind, start_serve
from tests.serve.test_api import metric

SUFFIX = INFERLETS["suffix"]
ASK = "Describe {} as one JSON object with the fields name, color, taste and price. Answer with the JSON only."
# the static index: JSON in the shape the requests ask for, about other items
CORPUS = [
    '{"name": "pear", "color": "green", "taste": "sweet", "price": "$1.50"}',
    '{"name": "lemon", "color": "yellow", "taste": "sour", "price": "$0.80"}',
]


def test_parse_the_suffix_policy():
    assert parse_policy(None, None, None, "8") == Policy(method="suffix", k=8)
    assert parse_policy(None, None, None, "8:16", "/x.npz") == Policy(
        method="suffix", k=8, tree_rows=16, suffix_index="/x.npz"
    )
    for bad in [("0",), ("8:",), (":4",), ("8:999",), ("x",)]:
        with pytest.raises(PolicyRefused):
            parse_policy(None, None, None, *bad)
    with pytest.raises(PolicyRefused, match="exclude each other"):
        parse_policy("3:4", None, None, "8")
    with pytest.raises(PolicyRefused, match="needs --draft-suffix"):
        parse_policy(None, None, None, None, "/x.npz")


def test_choose_suffix_decoding():
    policy = Policy(method="suffix", k=8, tree_rows=16, suffix_index="/x.npz")
    name, args = choose(policy, Capabilities(), None, None)
    assert name == SUFFIX and args["draft_length"] == 8 and args["tree_rows"] == 16
    assert args["suffix_index"] == "/x.npz"
    # a request's own k keeps the server's store arguments: the same shared store serves it
    _, asked = choose(policy, Capabilities(), SpeculationRequest(method="suffix", k=4), None)
    assert asked == {**args, "draft_length": 4}
    assert choose(policy, Capabilities(), False, None) == ("text-completion", {})
    with pytest.raises(Exception, match="past this server's limit"):
        choose(policy, Capabilities(), SpeculationRequest(method="suffix", k=9), None)
    name, args = choose(None, Capabilities(), SpeculationRequest(method="suffix", k=4), None)  # no policy: allowed
    assert name == SUFFIX and "suffix_index" not in args


def build_index(path: Path, docs: list[list[int]]) -> Path:
    from inferlet.spec.suffix_index import SuffixIndex

    index = SuffixIndex()
    for d in docs:
        index.add(d)
    index.save(path)
    return path


def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(ModelStore().path(DEFAULT_MODEL)) / "tokenizer.json"))


@pytest.fixture(scope="module")
def index_file(tmp_path_factory) -> Path:
    tok = tokenizer()
    return build_index(tmp_path_factory.mktemp("suffix") / "index.npz", [tok.encode(t).ids for t in CORPUS])


def refusals(tmp: Path) -> list[tuple[list[str], str]]:
    not_index = tmp / "not-an-index.npz"
    not_index.write_bytes(b"these bytes are not an index")
    other = tmp / "other.npz"
    np.savez(other, meta=np.array(json.dumps({"format": "something-else"})))
    past_vocab = build_index(tmp / "past-vocab.npz", [[1, 2, 3, 10_000_000]])
    return [
        (["--draft-suffix", "8", "--suffix-index", str(tmp / "missing.npz")], "no such file"),
        (["--draft-suffix", "8", "--suffix-index", str(not_index)], "not a suffix index"),
        (["--draft-suffix", "8", "--suffix-index", str(other)], "not a suffix index"),
        (["--draft-suffix", "8:16", "--suffix-index", str(past_vocab)], "past the model's vocabulary"),
    ]  # the flags' own refusals (K out of range, --suffix-index alone) go the same way: test_parse_the_suffix_policy


@pytest.mark.e2e
def test_a_bad_suffix_index_stops_startup_before_binding(pie_home, tmp_path):
    for flags, says in refusals(tmp_path):
        assert_refused_before_bind(pie_home, TINY, flags, says)


# ---- on a real server ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def suffix_server(pie_home, index_file):
    """The default model under the suffix policy, its hosts' stores started from the static index. No pass-cost
    curve: the planner drafts what the drafter offers, so what is asserted does not hang on a busy machine."""
    s = start_serve(
        pie_home,
        DEFAULT_MODEL,
        "--kv-pages",
        "1024",
        "--pass-cost-rows",
        "0",
        "--draft-suffix",
        "8",
        "--suffix-index",
        str(index_file),
    )
    yield s
    s.stop()


def complete(server, prompt: str, speculation=None) -> dict:
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 48,
        "temperature": 0,
        "return_token_ids": True,
    }
    if speculation is not None:
        body["speculation"] = speculation
    r = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def ids_of(res: dict) -> list[int]:
    choice = res["choices"][0]
    return choice.get("token_ids") or choice["message"].get("token_ids") or []


@pytest.mark.e2e
def test_suffix_policy_serves_greedy_text_and_drafts_across_requests(suffix_server):
    plain = complete(suffix_server, ASK.format("a red apple"), speculation=False)
    assert plain.get("speculation") is None
    first = complete(suffix_server, ASK.format("a red apple"))
    assert first["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert ids_of(first) == ids_of(plain)
    s1 = first["speculation"]
    assert s1["rounds"] > 0
    assert s1["drafted_from"]["store"] > 0  # the static index's JSON, before any output was stored
    again = complete(suffix_server, ASK.format("a red apple"))  # drafts the first's output from the store
    assert ids_of(again) == ids_of(first)
    s2 = again["speculation"]
    assert s2["accepted"] > s1["accepted"] + 10 and s2["rounds"] < s1["rounds"]
    similar = complete(suffix_server, ASK.format("a green apple"))
    assert similar["speculation"]["drafted_from"]["store"] > 0 and similar["speculation"]["accepted"] > 0
    assert metric(suffix_server, "pie_speculative_accepted_tokens", inferlet=SUFFIX) >= s1["accepted"] + s2["accepted"]
