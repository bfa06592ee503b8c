"""`pie drafter train --kind mtp` on targets with recurrent state (tiny random Mamba and LFM2): the teacher
pass runs the model's own forward (distill/stateful.py), whose batched greedy continuation carries each
sequence's state from step to step; the head it trains attaches and is served; other kinds are refused."""

from __future__ import annotations

import pytest
import torch

from pie_runtime.distill.stateful import stateful_generate, stateful_hidden
from pie_runtime.store import ModelStore, import_model, load_model
from tests.drafter_fixtures import pie
from tests.models.tiny_models import RECURRENT_FAMILIES, write_tiny_checkpoint

TEXT = "the cat sat on the mat and the dog sat on the log. " * 40


@pytest.fixture(scope="module", params=RECURRENT_FAMILIES)
def home(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"train-{request.param}")
    write_tiny_checkpoint(root / "ckpt", request.param)
    import_model(str(root / "ckpt"), name="tiny", store=ModelStore(root / "home" / "models"), progress=False)
    (root / "corpus.txt").write_text(TEXT)
    return root


def test_the_teachers_greedy_steps_carry_the_state(home):
    model = load_model("tiny", store=ModelStore(home / "home" / "models")).model
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    tokens, hidden = stateful_generate(model, prompts, 5)
    whole = stateful_hidden(model, tokens)  # the same sequences in one pass
    torch.testing.assert_close(hidden, whole, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens[:, 5:], model.logits(whole[:, 4:-1]).argmax(-1))


def test_pie_drafter_train_mtp_attaches_a_head(home):
    common = ["--model", "tiny", "--corpus", str(home / "corpus.txt"), "--cache-dir", "none", "--quiet"]
    common += ["--tokens", "512", "--gen-tokens", "128", "--seq-len", "64", "--heldout-tokens", "128"]
    common += ["--threads", "1", "--precision", "fp32"]
    out = ["--out", str(home / "head.safetensors")]
    pie(home / "home", "drafter", "train", "--kind", "mtp", "--depth", "2", "--epochs", "1", "--attach", *out, *common)
    drafters = ModelStore(home / "home" / "models").get("tiny").drafters
    assert [d.kind for d in drafters] == ["mtp"]
    refused = pie(home / "home", "drafter", "train", "--kind", "eagle", *common, check=False)
    assert refused.returncode == 1 and "only --kind mtp" in refused.stderr
