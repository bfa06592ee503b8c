"""Fixtures of the speculative inferlets' tests: one engine serving the default model (with a briefly trained
MTP head and EAGLE head attached, in a private store) and a draft model cut from it (layers 0..1 + final
norm, sharing its embedding), and a way to call an inferlet in-process."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pie_runtime.drafters import attach
from pie_runtime.store import DEFAULT_MODEL, ModelStore
from tests.conftest import REPO, start_engine
from tests.drafter_fixtures import link_model

SLICE = "smol-slice"
INFERLETS = REPO / "inferlets"


def write_slice(folder: Path, source: Path, layers: int = 2) -> None:
    """A Hugging Face folder holding the first ``layers`` layers of the model in ``source`` (a store folder),
    in float32 (a store may keep weights as quantized blocks: they are dequantized)."""
    from safetensors.torch import save_file

    from pie_runtime.store import load_model

    cfg = json.loads((source / "manifest.json").read_text())["config"]
    folder.mkdir(parents=True)
    keep = ("model.embed_tokens.", "model.norm.") + tuple(f"model.layers.{i}." for i in range(layers))
    state = load_model(source.name, store=ModelStore(source.parent), keep_quantized=False).model.state_dict()
    save_file({k: v.contiguous() for k, v in state.items() if k.startswith(keep)}, folder / "model.safetensors")
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": cfg["rope_theta"],
        "tie_word_embeddings": True,
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_ids"][0],
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(hf))
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")


@pytest.fixture(scope="session")
def spec_home(pie_home, mtp_head, eagle_head, tmp_path_factory) -> Path:
    """A store of its own: the default model (files linked, manifest copied) with the session's MTP and EAGLE
    heads attached, and the slice draft model. The real store's default model stays without drafters."""
    if not (pie_home / "models" / SLICE).exists():
        ckpt = pie_home / "slice-ckpt"
        write_slice(ckpt, ModelStore().path(DEFAULT_MODEL))
        pie = REPO / ".venv/bin/pie"
        subprocess.run(
            [str(pie) if pie.exists() else "pie", "model", "import", str(ckpt), "--name", SLICE],
            check=True,
            env={**os.environ, "PIE_HOME": str(pie_home)},
            capture_output=True,
        )
    home = tmp_path_factory.mktemp("spec-home")
    link_model((pie_home / "models" / DEFAULT_MODEL).resolve(), home / "models" / DEFAULT_MODEL)
    link_model(pie_home / "models" / SLICE, home / "models" / SLICE)
    attach(ModelStore(home / "models"), DEFAULT_MODEL, f"mtp:{mtp_head}", "head")
    attach(ModelStore(home / "models"), DEFAULT_MODEL, f"eagle:{eagle_head}", "eagle")
    return home


@pytest.fixture(scope="session")
def spec_engine(spec_home):
    """The default model (the target, served first, with an MTP head) and the slice draft model, with room
    for many rows. No pass-cost curve: the adaptive planner then drafts ``--draft-length`` every round, so
    what these tests assert (drafts proposed and kept) does not hang on costs timed at start on a busy
    machine (a CI run once measured a curve under which no round drafted)."""
    eng = start_engine(spec_home, [DEFAULT_MODEL, SLICE], "--kv-pages", "2048", "--pass-cost-rows", "0")
    yield eng
    eng.stop()


def load(name: str):
    """(main, Args) of a shipped inferlet, loaded in this process."""
    path = INFERLETS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"inferlet_{name.replace('-', '_')}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as the SDK's runtime loads it: pydantic resolves Args' annotations there
    spec.loader.exec_module(module)
    return module.main, module.Args


def call_many(address: str, name: str, arg_sets: list[dict]) -> list[dict]:
    """Runs an inferlet once per argument set, all at once on one connection (the engine batches them)."""
    import inferlet

    main, Args = load(name)

    async def go():
        session = await inferlet.connect(address)
        try:
            return await asyncio.gather(*(main(Args(stream=False, **a)) for a in arg_sets))
        finally:
            session.client.close()

    return asyncio.run(go())


def call(address: str, name: str, **args) -> dict:
    return call_many(address, name, [args])[0]
