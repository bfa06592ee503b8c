"""Schemathesis against a real `pie serve`'s published OpenAPI schema: a bounded number of generated requests
per operation, valid and invalid. Every answer must be a status the schema documents, with a body that fits
it (every refusal an OpenAI error object), and none a 5xx; the server serves normally afterwards."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from pie_runtime.serve.openai_api import ErrorResponse
from pie_runtime.store import DEFAULT_MODEL, ModelStore
from tests.conftest import TINY
from tests.serve.server_proc import alive, start_serve

pytestmark = pytest.mark.e2e

EXAMPLES = 20  # per operation and mode; the module runs in about a minute
HEALTH_CHECKS = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_server(pie_home, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(ModelStore(pie_home / "models").get(DEFAULT_MODEL).tokenizer.chat_template or "")
    flags = ["--chat-template", str(template), "--kv-pages", "256", "--max-n", "2", "--max-tokens", "16"]
    s = start_serve(pie_home, TINY, *flags, "--max-body-bytes", "65536", "--pass-cost-rows", "0")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.base}/openapi.json")


def fuzz(operation, mode: GenerationMode) -> None:
    """EXAMPLES requests to ``operation`` from its schema (``mode``: fitting it or not), each answer checked."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=HEALTH_CHECKS,
        derandomize=True,  # the same requests every run: CI must not turn red on a new draw (explore by hand)
    )
    def one(case) -> None:
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = TINY  # a served model's name, so that valid requests reach a run
        response = case.call(timeout=60)
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400:
            ErrorResponse.model_validate(response.json())

    one()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_answer_is_documented_and_no_5xx(api_schema, mode):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "GET /v1/models",
        "POST /tokenize",
    }
    nothing_wrong = []  # operations with no input that can be sent wrong (only optional string headers)
    for operation in operations:
        try:
            fuzz(operation, mode)
        except Unsatisfiable:
            if mode != GenerationMode.NEGATIVE:
                raise
            nothing_wrong.append(f"{operation.method.upper()} {operation.path}")
    assert not {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize"} & set(nothing_wrong)


def test_the_server_serves_after_the_fuzzing(fuzz_server):
    assert alive(fuzz_server.proc.pid)
    assert httpx.get(f"{fuzz_server.base}/health", timeout=30).status_code == 200
    body = {"model": TINY, "prompt": "still there?", "max_tokens": 2}
    r = httpx.post(f"{fuzz_server.base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    docs = httpx.get(f"{fuzz_server.base}/docs", timeout=30)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
