"""Fixtures for the model tests: the tiny checkpoints imported through `pie model import` into a temporary
store, the default model from the real store, and greedy decoding over the paged cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pie_runtime.cli.main import main as pie
from pie_runtime.models.context import ForwardContext, Segment
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.llama import LlamaForCausalLM
from pie_runtime.shipped import ensure_default_model
from pie_runtime.store import LoadedModel, ModelStore, load_model
from tests.models.tiny_models import ALL_FAMILIES, write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> tuple[ModelStore, dict[str, Path]]:
    """Each family's tiny checkpoint, imported with `pie model import` into a temporary PIE_HOME."""
    root = tmp_path_factory.mktemp("tiny")
    home = root / "home"
    folders = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIE_HOME", str(home))
        for family in ALL_FAMILIES:
            folder = root / f"ckpt-{family}"
            write_tiny_checkpoint(folder, family)
            assert pie(["model", "import", str(folder), "--name", f"tiny-{family}"]) == 0
            folders[family] = folder
    return ModelStore(home / "models"), folders


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """The default model from the real store (imported on first use)."""
    ensure_default_model()
    return load_model("smollm2-135m")


@pytest.fixture
def greedy() -> Callable[[LlamaForCausalLM, list[int], int], list[int]]:
    def generate(model: LlamaForCausalLM, ids: list[int], n: int) -> list[int]:
        page_size = 16
        pages = (len(ids) + n) // page_size + 1
        kv = KVCache(model.config, pages, page_size, torch.float32)
        table = list(range(pages))
        ids = list(ids)
        start, new = 0, []
        for _ in range(n):
            ctx = ForwardContext.build([Segment(table, start, len(ids) - start)], page_size)
            hidden = model.forward(model.embed(torch.tensor(ids[start:])), ctx, kv)
            token = int(model.logits(hidden[-1:]).argmax(-1))
            start = len(ids)
            ids.append(token)
            new.append(token)
        return new

    return generate
