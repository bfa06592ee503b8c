"""constrained-speculative-decoding on the real default model: the output parses and validates on every case,
speculation does not change it (draft length 0 is the plain masked decode), sampled output validates too."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.inferlets.conftest import call_many

NAME = "constrained-speculative-decoding"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
COLORS = {
    "type": "object",
    "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
    },
    "required": ["colors"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "capital"],
    "additionalProperties": False,
}

CASES = [
    (
        {"json_schema": json.dumps(PERSON), "prompt": "Give a JSON object for a person named Alice who is 30."},
        lambda t: jsonschema.validate(json.loads(t), PERSON),
    ),
    (
        {"json_schema": json.dumps(COLORS), "prompt": "List two colors of the French flag as JSON."},
        lambda t: jsonschema.validate(json.loads(t), COLORS),
    ),
    (
        {"json_schema": json.dumps(CITY), "prompt": "Describe Paris as JSON."},
        lambda t: jsonschema.validate(json.loads(t), CITY),
    ),
    (
        {"regex": r"\d{3}-\d{4}", "prompt": "Make up a phone number like 555-1234."},
        lambda t: re.fullmatch(r"\d{3}-\d{4}", t) or pytest.fail(t),
    ),
    (
        {"grammar": 'start: "yes" | "no"', "prompt": "Is the sky blue? Answer yes or no."},
        lambda t: t in ("yes", "no") or pytest.fail(t),
    ),
]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_output_parses_validates_and_matches_plain_masked_decoding(spec_engine, temperature):
    base = [{**case, "chat": True, "max_tokens": 64, "temperature": temperature, "seed": 3} for case, _ in CASES]
    spec = call_many(spec_engine.address, NAME, base)
    for (_, check), res in zip(CASES, spec):
        assert res["finish_reason"] == "stop", res
        check(res["text"])
        assert res["stats"]["grammar_accepting"]
    assert sum(r["stats"]["accepted"] for r in spec) > 0  # forced tokens and lookups were kept
    if temperature == 0:
        plain = call_many(spec_engine.address, NAME, [{**a, "draft_length": 0} for a in base])
        assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
        assert all(r["stats"]["proposed"] == 0 for r in plain)
