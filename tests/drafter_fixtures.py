"""Drafter fixtures shared by tests/drafters and tests/inferlets (loaded as a pytest plugin from
tests/conftest.py): a slice of the corpus with its own teacher cache, an MTP head trained once per session on
it, and helpers that build private stores (model folders whose big files link to the real store's and whose
manifests are copies, so attaching a drafter never touches the real store)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pie_runtime.distill import CORPUS_ENV, corpus_folders, find_corpus
from pie_runtime.store import MANIFEST_FILE

CORPUS = find_corpus("austen.txt")  # None: every test that trains a drafter skips
MTP_DEPTH = 2  # the session head's depth
EAGLE_DEPTH = 3  # the session EAGLE head's depth
EAGLE_VOCAB = 2048  # the session EAGLE head's draft vocabulary


def pie(home: Path, *words: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs the real `pie` command line with PIE_HOME=home."""
    env = {**os.environ, "PIE_HOME": str(home)}
    proc = subprocess.run(
        [sys.executable, "-m", "pie_runtime.cli.main", *words], env=env, capture_output=True, text=True
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"pie {' '.join(words)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def link_model(src: Path, dst: Path, keep_heads: bool = False) -> None:
    """A model folder whose data files link to ``src``'s and whose manifest is a private copy without
    drafters: the tests attach their own, and one a developer attached in the real store is not theirs. With
    ``keep_heads`` it keeps the MTP and EAGLE heads (their folder linked too: the shipped head) and drops only
    draft models, which are not in the tests' store."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == MANIFEST_FILE:
            manifest = json.loads(f.read_text())
            if keep_heads:
                manifest["drafters"] = [d for d in manifest["drafters"] if d["kind"] != "draft"]
            else:
                manifest["drafters"] = []
                manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("drafters/")}
            (dst / f.name).write_text(json.dumps(manifest, indent=2))
        elif not f.name.startswith(".") and (f.is_file() or keep_heads):
            (dst / f.name).symlink_to(f.resolve(), target_is_directory=f.is_dir())


@pytest.fixture(scope="session")
def distill_slice(tmp_path_factory) -> tuple[Path, list[str]]:
    """(folder, common `pie drafter train` flags): a corpus slice (2k tokens to train on and a held-out tail)
    and one teacher cache for every drafter trained on it. The target's forward over the slice is most of
    a trained drafter's time: about 30 s on two idle cores, paid once per session."""
    if CORPUS is None:
        searched = ", ".join(str(f) for f in corpus_folders())
        pytest.skip(f"no corpus file austen.txt (searched {searched}; set {CORPUS_ENV} to a folder holding it)")
    folder = tmp_path_factory.mktemp("distill")
    text = CORPUS.read_text(encoding="utf-8", errors="replace")
    corpus = folder / "corpus.txt"
    corpus.write_text(text[:40000])
    common = [
        "--corpus",
        str(corpus),
        "--tokens",
        "2048",
        "--seq-len",
        "128",
        "--heldout-tokens",
        "256",
        "--cache-dir",
        str(folder / "cache"),
        "--quiet",
        "--threads",
        "2",
    ]
    return folder, common


@pytest.fixture(scope="session")
def mtp_head(pie_home, distill_slice) -> Path:
    """An MTP head (depth 2) for the default model, trained briefly on the slice (8 epochs, about 35 s on two
    cores): good enough to be accepted now and then (0.2 held out), which is all the serving tests need."""
    folder, common = distill_slice
    out = folder / "head.safetensors"
    pie(
        pie_home,
        "drafter",
        "train",
        "--kind",
        "mtp",
        "--depth",
        str(MTP_DEPTH),
        "--epochs",
        "8",
        "--out",
        str(out),
        *common,
    )
    return out


@pytest.fixture(scope="session")
def eagle_head(pie_home, distill_slice) -> Path:
    """An EAGLE head (depth 3) for the default model, trained for a few steps on the slice (sharing the MTP
    head's teacher cache): exactness does not depend on its quality, and its draft layer starts from the
    target's last one, so it is accepted now and then. It drafts from a reduced vocabulary (``EAGLE_VOCAB``
    tokens), so the EAGLE tests also hold drafts whose distribution is zero outside a slice to exactness."""
    folder, common = distill_slice
    out = folder / "eagle.safetensors"
    pie(
        pie_home,
        "drafter",
        "train",
        "--kind",
        "eagle",
        "--depth",
        str(EAGLE_DEPTH),
        "--epochs",
        "3",
        "--draft-vocab",
        str(EAGLE_VOCAB),
        "--out",
        str(out),
        *common,
    )
    return out
