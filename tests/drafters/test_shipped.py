"""The drafters shipped with the project: their files match the recorded digests and records, `pie model import`
of the packaged model attaches them, and the MTP inferlet runs on the shipped head right away, its greedy
tokens equal to text-completion's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pie_runtime.cli.drafter import portable_path
from pie_runtime.drafters import attach, detach, target_digest
from pie_runtime.launcher import REPO_ROOT
from pie_runtime.models.mtp import load_mtp, read_config, save_mtp
from pie_runtime.shipped import (
    SHIPPED,
    ShippedDrafter,
    ShippedDrafterCorrupt,
    check_shipped,
    ensure_default_model,
    stale_shipped,
)
from pie_runtime.store import DEFAULT_MODEL, ModelStore
from tests.conftest import run, start_engine
from tests.drafter_fixtures import link_model, pie

SHIPPED_HEAD = SHIPPED[DEFAULT_MODEL][0]
BY_NAME = [d for d in SHIPPED[DEFAULT_MODEL] if not d.on_import]  # kept for comparison, attached by name only


def test_shipped_files_have_their_recorded_digests():
    for drafters in SHIPPED.values():
        for d in drafters:
            assert check_shipped(d) == d.path


def test_a_shipped_file_with_another_digest_is_refused():
    forged = ShippedDrafter(SHIPPED_HEAD.name, SHIPPED_HEAD.kind, SHIPPED_HEAD.file, "0" * 64)
    with pytest.raises(ShippedDrafterCorrupt, match="recorded"):
        check_shipped(forged)


def test_shipped_head_record_names_no_machine_paths():
    cfg = read_config(SHIPPED_HEAD.path)
    text = json.dumps(cfg.training)
    assert cfg.training["heldout_acceptance"] and cfg.training["train_cpu_s"] > 0
    assert '"/' not in text and "~/" not in text, text  # no absolute path anywhere in the record
    assert all(c.startswith("../shared/corpus/") for c in cfg.training["corpus"])


def test_portable_path(tmp_path):
    assert portable_path(REPO_ROOT.parent / "shared" / "corpus" / "austen.txt") == "../shared/corpus/austen.txt"
    assert portable_path(REPO_ROOT / "examples" / "x.json") == "examples/x.json"
    assert portable_path(Path("/elsewhere/private/kjv.txt")) == "kjv.txt"


@pytest.fixture
def fresh_home(pie_home, tmp_path) -> Path:
    """A store holding the default model without drafters (its files linked, its manifest copied)."""
    link_model((pie_home / "models" / DEFAULT_MODEL).resolve(), tmp_path / "models" / DEFAULT_MODEL)
    return tmp_path


@pytest.mark.e2e
def test_import_attaches_the_shipped_head_once(fresh_home):
    out = pie(fresh_home, "model", "import", DEFAULT_MODEL)
    assert f"attached the shipped mtp drafter {SHIPPED_HEAD.name}" in out.stdout
    manifest = ModelStore(fresh_home / "models").get(DEFAULT_MODEL)
    assert [(d.kind, d.name) for d in manifest.drafters] == [("mtp", SHIPPED_HEAD.name)]
    assert read_config(SHIPPED_HEAD.path).target_digest == target_digest(manifest)
    again = pie(fresh_home, "model", "import", DEFAULT_MODEL)  # already there: nothing attached twice
    assert "attached" not in again.stdout
    assert len(ModelStore(fresh_home / "models").get(DEFAULT_MODEL).drafters) == 1


@pytest.mark.e2e
def test_a_shipped_head_kept_by_name_attaches_by_name_and_serves_once_first(fresh_home):
    """`pie model import` leaves a by-name shipped head out; `pie model drafter attach MODEL NAME` attaches its
    file under its name; detaching the default head leaves it the one a model serves (its first MTP head)."""
    assert BY_NAME, "the earlier default head ships beside the current one"
    old = BY_NAME[0]
    pie(fresh_home, "model", "import", DEFAULT_MODEL)
    out = pie(fresh_home, "model", "drafter", "attach", DEFAULT_MODEL, old.name)
    assert f"attached mtp drafter {old.name}" in out.stdout
    store = ModelStore(fresh_home / "models")
    manifest = store.get(DEFAULT_MODEL)
    assert [d.name for d in manifest.drafters] == [SHIPPED_HEAD.name, old.name]
    entry = manifest.drafters[1]
    assert manifest.files[entry.path] == old.sha256 != SHIPPED_HEAD.sha256
    detach(store, DEFAULT_MODEL, SHIPPED_HEAD.name)
    ensure_default_model(store)  # a detached shipped head stays detached, the by-name one stays
    assert [d.name for d in store.get(DEFAULT_MODEL).drafters] == [old.name]
    bad = pie(fresh_home, "model", "drafter", "attach", DEFAULT_MODEL, "no-such-head", check=False)
    assert bad.returncode != 0 and "mtp:FILE" in bad.stderr


@pytest.mark.e2e
def test_mtp_inferlet_on_the_shipped_head_equals_text_completion(fresh_home):
    pie(fresh_home, "model", "import", DEFAULT_MODEL)
    eng = start_engine(fresh_home, [DEFAULT_MODEL], "--weights", "int4", "--pass-cost-rows", "8")
    try:
        words = ["--prompt", "The history of the lighthouse", "--max-tokens", "48", "--temperature", "0"]
        plain = run("text-completion", eng.address, *words)
        # fixed: draft every round (the planner may take plain steps when the machine is busy)
        spec = run("mtp-speculative-decoding", eng.address, *words, "--draft-length", "2", "--draft-schedule", "fixed")
        assert spec["token_ids"] == plain["token_ids"]
        assert spec["speculation"]["accepted"] > 0  # the head drafts, and is sometimes right
    finally:
        eng.stop()


@pytest.mark.e2e
def test_an_older_releases_shipped_head_is_replaced_and_a_detached_one_stays_detached(fresh_home, tmp_path):
    """A store whose shipped head came from an older release (another file under the shipped name) gets this
    release's on the default model's next use; the user's own heads, and a shipped head they detached, stay."""
    older = tmp_path / "older.safetensors"  # the shipped head in float32: a valid head with another digest
    save_mtp(load_mtp(SHIPPED_HEAD.path), older, dtype=torch.float32)
    store = ModelStore(fresh_home / "models")
    attach(store, DEFAULT_MODEL, f"mtp:{older}", SHIPPED_HEAD.name)
    attach(store, DEFAULT_MODEL, f"mtp:{older}", "mine")
    assert [d.name for d in stale_shipped(store.get(DEFAULT_MODEL))] == [SHIPPED_HEAD.name]
    ensure_default_model(store)
    manifest = store.get(DEFAULT_MODEL)
    assert sorted(d.name for d in manifest.drafters) == sorted(["mine", SHIPPED_HEAD.name])
    entry = next(d for d in manifest.drafters if d.name == SHIPPED_HEAD.name)
    assert manifest.files[entry.path] == SHIPPED_HEAD.sha256 and not stale_shipped(manifest)
    detach(store, DEFAULT_MODEL, SHIPPED_HEAD.name)
    ensure_default_model(store)
    assert [d.name for d in store.get(DEFAULT_MODEL).drafters] == ["mine"]
