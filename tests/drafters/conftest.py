"""Fixtures for the drafter tests: a store of its own (the default model's files linked, its manifest
copied, so attaching never touches the real store), drafters trained once per session on a slice of the
corpus, and crafted models that every check must refuse."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from pie_runtime.store import DEFAULT_MODEL, MANIFEST_FILE, ModelStore
from tests.conftest import TINY
from tests.drafter_fixtures import link_model, pie

DRAFT = "smol-draft"  # the draft model trained by the session fixture


def snapshot(home: Path) -> dict[str, str]:
    """Every file under the store (links by target), with a digest of the small ones: 'unchanged' means equal."""
    out = {}
    for p in sorted((home / "models").rglob("*")):
        rel = str(p.relative_to(home))
        if p.name == ".verified.json":
            continue
        if p.is_symlink():
            out[rel] = "->" + os.readlink(p)
        elif p.is_file():
            size = p.stat().st_size
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if size < 1 << 20 else str(size)
        else:
            out[rel] = "dir"
    return out


def craft(
    home: Path, base: str, name: str, config: dict | None = None, top: dict | None = None, tokenizer=None
) -> None:
    """A store model copied from ``base`` with its manifest's config (and top level) edited: only the checks
    read it, never a forward."""
    src = home / "models" / base
    link_model(src, home / "models" / name)
    manifest = json.loads((src / MANIFEST_FILE).read_text())
    manifest["name"] = name
    manifest["config"].update(config or {})
    manifest.update(top or {})
    if tokenizer is not None:
        path = home / "models" / name / "tokenizer.json"
        path.unlink()
        path.write_text(tokenizer)
        manifest["files"]["tokenizer.json"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (home / "models" / name / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))


def swapped_tokenizer(tokenizer_json: Path) -> str:
    """The same tokenizer with two tokens' ids exchanged."""
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    a, b = "the", "and"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return json.dumps(data)


@pytest.fixture(scope="session")
def drafter_home(pie_home, distill_slice, tmp_path_factory) -> Path:
    """A store with the default model, tiny-smol, and crafted refusable models; drafters trained once."""
    home = tmp_path_factory.mktemp("drafter-home")
    models = home / "models"
    link_model((pie_home / "models" / DEFAULT_MODEL).resolve(), models / DEFAULT_MODEL)
    link_model(pie_home / "models" / TINY, models / TINY)
    target_positions = ModelStore(models).get(DEFAULT_MODEL).config.max_position_embeddings
    craft(home, TINY, "big-vocab", {"vocab_size": 50000, "max_position_embeddings": target_positions})
    craft(home, TINY, "short-context")  # 2048 positions, the target has 8192
    craft(
        home,
        TINY,
        "swapped-ids",
        {"max_position_embeddings": target_positions},
        tokenizer=swapped_tokenizer(models / TINY / "tokenizer.json"),
    )
    craft(home, TINY, "recurrent", {"max_position_embeddings": target_positions, "recurrent": True})

    # the draft model shares the MTP head's corpus slice and teacher cache (tests/drafter_fixtures.py)
    folder, common = distill_slice
    shutil.copyfile(folder / "corpus.txt", home / "corpus.txt")
    pie(
        home,
        "drafter",
        "train",
        "--kind",
        "draft",
        "--layers",
        "0,-1",
        "--epochs",
        "5",  # about 10 s: held-out acceptance 0.1-0.2 at the first draft; the tests need it above chance only
        "--batch",
        "2",
        "--lr",
        "1e-3",
        "--out",
        DRAFT,
        *common,
    )
    return home


@pytest.fixture(scope="session")
def head(mtp_head) -> Path:
    return mtp_head
