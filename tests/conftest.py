"""Shared fixtures: real engine processes (the default model, and a tiny random model that shares its
tokenizer), and a helper that runs an inferlet through the real launcher path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from pie_runtime.launcher import EmbeddedEngine, resolve_inferlet, run_inferlet
from pie_runtime.shipped import ensure_default_model
from pie_runtime.store import DEFAULT_MODEL, ModelStore
from tests.drafter_fixtures import link_model

pytest_plugins = ["tests.drafter_fixtures"]  # distill_slice, mtp_head: shared by tests/drafters and tests/inferlets

REPO = Path(__file__).resolve().parents[1]
TINY = "tiny-smol"  # random weights, SmolLM2's tokenizer and vocab: cheap, so engine overhead shows

# Fixtures that start processes: an engine, an inferlet, or a `pie` command line (an import, a drafter's training).
# A test that uses one, itself or through another fixture, is marked e2e, and `-m "not e2e"` is the fast suite.
# A test that starts a process in its own body is marked in its module instead (`pytestmark = pytest.mark.e2e`).
PROCESS_FIXTURES = frozenset(
    {"pie_home", "engine", "tiny_engine", "tiny", "spec_home", "spec_engine", "mtp_head", "drafter_home"}
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


def write_tiny_smol(folder: Path, tokenizer_json: Path, seed: int = 0) -> None:
    """A 2-layer random Llama checkpoint with the default model's vocabulary and tokenizer."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        # transformers 5 takes rope_theta through **kwargs, which its signature does not show
        rope_theta=10000.0,  # pyright: ignore[reportCallIssue]
    )
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(folder, safe_serialization=True)
    shutil.copy(tokenizer_json, folder / "tokenizer.json")


def home_with_checkpoint(tmp_path_factory, prefix: str, name: str, write: Callable[[Path, Path], None]) -> Path:
    """A fresh PIE_HOME holding one Hugging Face checkpoint that ``write(folder, tokenizer_json)`` makes (with the
    default model's tokenizer), imported by the ``pie`` CLI as ``name``."""
    real = ensure_default_model()
    home = tmp_path_factory.mktemp(prefix)
    (home / "models").mkdir()
    ckpt = home / "ckpt"
    write(ckpt, ModelStore().path(real.name) / "tokenizer.json")
    pie = str(REPO / ".venv/bin/pie") if (REPO / ".venv/bin/pie").exists() else "pie"
    env = {**os.environ, "PIE_HOME": str(home)}
    subprocess.run([pie, "model", "import", str(ckpt), "--name", name], check=True, env=env, capture_output=True)
    return home


@pytest.fixture(scope="session")
def pie_home(tmp_path_factory) -> Path:
    """A store with the real default model (linked, read-only use) and the tiny model."""
    real = ensure_default_model()
    real_dir = ModelStore().path(real.name)
    home = tmp_path_factory.mktemp("pie-home")
    (home / "models").mkdir()
    link_model(real_dir, home / "models" / DEFAULT_MODEL, keep_heads=True)
    ckpt = home / "tiny-ckpt"
    write_tiny_smol(ckpt, real_dir / "tokenizer.json")
    env = {**os.environ, "PIE_HOME": str(home)}
    subprocess.run(
        [
            str(REPO / ".venv/bin/pie") if (REPO / ".venv/bin/pie").exists() else "pie",
            "model",
            "import",
            str(ckpt),
            "--name",
            TINY,
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    return home


def start_engine(pie_home: Path, models: list[str], *extra: str) -> EmbeddedEngine:
    """An engine in fp32 (the format that matches transformers; tests of other formats pass --weights, which
    the later flag sets), without compiling."""
    args = ["--kv-pages", "256", "--weights", "fp32", "--no-compile", *extra]
    return EmbeddedEngine(models, args, env={"PIE_HOME": str(pie_home)})


@pytest.fixture(scope="session")
def engine(pie_home):
    """One engine on the default model for the whole session."""
    eng = start_engine(pie_home, [DEFAULT_MODEL])
    yield eng
    eng.stop()


@pytest.fixture
async def tiny(tiny_engine):
    """An SDK session on the tiny engine, yielding the tiny model's handle."""
    import inferlet

    session = await inferlet.connect(tiny_engine.address)
    yield inferlet.model(TINY)
    session.client.close()


def in_session(address: str, body):
    """Runs ``body(model)`` in an SDK session on the engine at ``address``; its result."""
    import asyncio

    import inferlet

    async def go():
        session = await inferlet.connect(address)
        try:
            return await body(inferlet.model())
        finally:
            session.client.close()

    return asyncio.run(go())


async def pages_free(model) -> int:
    """Free KV pages of ``model``'s pool, from the engine's stats."""
    return (await model.client.request("stats"))["models"][model.name]["pages_free"]


@pytest.fixture(scope="session")
def tiny_engine(pie_home):
    eng = start_engine(pie_home, [TINY])
    yield eng
    eng.stop()


def run(name_or_file: str, address: str, *words: str, timeout: float = 600) -> dict:
    """Runs an inferlet through the launcher; returns its result, or fails the test with its error."""
    outcome = run_inferlet(
        resolve_inferlet(name_or_file), address, list(words), stdout=subprocess.DEVNULL, timeout=timeout
    )
    assert outcome["ok"], outcome.get("error")
    return outcome["result"]


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True)
