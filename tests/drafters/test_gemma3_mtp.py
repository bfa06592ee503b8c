"""`pie drafter train --kind mtp` on the real Gemma 3 270M (the packaged Q4_K_M GGUF): its 262,144-token
vocabulary gets a reduced draft vocabulary by default (a whole-vocabulary head would read most of the model per
draft step), the head attaches, and the MTP inferlet on it decodes text-completion's greedy tokens. A short
training run: the test checks that the path works, not that the head is good."""

from __future__ import annotations

import json

import pytest

from pie_runtime.distill.data import find_corpus
from pie_runtime.models.draft_vocab import AUTO_SLICE
from tests.conftest import run, start_engine
from tests.drafter_fixtures import pie

pytestmark = pytest.mark.e2e

MODEL = "gemma3-270m"


def test_an_mtp_head_trains_on_gemma3_with_a_reduced_vocabulary_and_decodes_exactly(tmp_path):
    corpus = find_corpus()
    if corpus is None:
        pytest.skip("no corpus: set PIE_CORPUS_DIR to a folder with austen.txt")
    pie(tmp_path, "model", "import", MODEL)
    trained = pie(
        tmp_path,
        *("drafter", "train", "--model", MODEL, "--kind", "mtp", "--corpus", str(corpus)),
        *("--tokens", "3000", "--heldout-tokens", "512", "--epochs", "1", "--threads", "2", "--attach"),
    )
    assert f"draft vocabulary: {AUTO_SLICE} tokens" in trained.stdout
    folder = tmp_path / "models" / MODEL / "drafters" / f"{MODEL}-mtp"
    record = json.loads((folder / "mtp.json").read_text())
    assert record["draft_vocab"] == AUTO_SLICE

    eng = start_engine(tmp_path, [MODEL], "--pass-cost-rows", "0")
    try:
        words = ["--prompt", "The history of the lighthouse", "--max-tokens", "24", "--temperature", "0"]
        plain = run("text-completion", eng.address, *words)
        spec = run("mtp-speculative-decoding", eng.address, *words, "--draft-length", "2", "--draft-schedule", "fixed")
        assert spec["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) > 0
        assert spec["speculation"]["proposed"] > 0  # the head drafted on every round it could
    finally:
        eng.stop()
