"""Drafters: every refusal at attach, import and engine start leaves the store as it was; a briefly trained
MTP head and draft model load, are served through a real engine, and agree with the target more often
than chance."""

from __future__ import annotations

import argparse
import json
import shutil

import numpy as np
import pytest

import inferlet
from pie_runtime.cli.engine import DEFAULT_WEIGHTS, add_engine_options, model_weights, named_format, weights_words
from pie_runtime.drafters import DrafterRefused, attach, check_attached, detach, heldout_acceptance, served_formats
from pie_runtime.launcher import LaunchError
from pie_runtime.models.formats import default_format
from pie_runtime.models.head_files import config_path
from pie_runtime.models.mtp import read_config
from pie_runtime.store import DEFAULT_MODEL, ModelStore, StoreError, StoreIntegrityError
from tests.conftest import TINY, start_engine
from tests.drafters.conftest import DRAFT, craft, link_model, pie, snapshot

REFUSALS = {
    "big-vocab": "larger than",
    "short-context": "positions, fewer than",
    "swapped-ids": "gives token",
    "recurrent": "recurrent state",
}


def store(home) -> ModelStore:
    return ModelStore(home / "models")


# ---- refusals at attach and import -------------------------------------------------------------------------


@pytest.mark.parametrize("bad", sorted(REFUSALS))
def test_draft_model_refused_at_attach(drafter_home, bad):
    before = snapshot(drafter_home)
    with pytest.raises(DrafterRefused, match=REFUSALS[bad]):
        attach(store(drafter_home), DEFAULT_MODEL, f"draft:{bad}")
    proc = pie(drafter_home, "model", "drafter", "attach", DEFAULT_MODEL, f"draft:{bad}", check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert REFUSALS[bad] in proc.stderr
    assert snapshot(drafter_home) == before


def test_mtp_head_refused_for_another_target(drafter_home, head):
    before = snapshot(drafter_home)
    with pytest.raises(DrafterRefused, match="hidden size"):
        attach(store(drafter_home), TINY, f"mtp:{head}")
    proc = pie(drafter_home, "model", "drafter", "attach", TINY, f"mtp:{head}", check=False)
    assert proc.returncode == 1 and "hidden size" in proc.stderr and proc.stderr.count("\n") == 1
    assert snapshot(drafter_home) == before


def test_mtp_head_with_another_digest_refused(drafter_home, head, tmp_path):
    other = tmp_path / "other.safetensors"
    shutil.copyfile(head, other)
    cfg = json.loads(config_path(head).read_text())
    cfg["target_digest"] = "0" * 64
    config_path(other).write_text(json.dumps(cfg))
    before = snapshot(drafter_home)
    with pytest.raises(DrafterRefused, match="trained for another target"):
        attach(store(drafter_home), DEFAULT_MODEL, f"mtp:{other}")
    assert snapshot(drafter_home) == before


def test_import_with_refused_drafter_leaves_store_unchanged(drafter_home, pie_home, head):
    before = snapshot(drafter_home)
    proc = pie(
        drafter_home,
        "model",
        "import",
        str(pie_home / "tiny-ckpt"),
        "--name",
        "tiny-again",
        "--drafter",
        f"mtp:{head}",
        check=False,
    )
    assert proc.returncode == 1 and "hidden size" in proc.stderr, proc.stderr
    proc = pie(
        drafter_home,
        "model",
        "import",
        str(pie_home / "tiny-ckpt"),
        "--name",
        "tiny-again",
        "--drafter",
        "nonsense",
        check=False,
    )
    assert proc.returncode == 1 and "mtp:FILE, eagle:FILE or draft:MODEL_NAME" in proc.stderr
    # --force over a stored model: the refusal comes before the new copy replaces the old one
    proc = pie(
        drafter_home,
        "model",
        "import",
        str(pie_home / "tiny-ckpt"),
        "--name",
        TINY,
        "--force",
        "--drafter",
        f"mtp:{head}",
        check=False,
    )
    assert proc.returncode == 1 and "hidden size" in proc.stderr, proc.stderr
    assert snapshot(drafter_home) == before


def test_engine_refuses_a_broken_drafter(drafter_home, head):
    """Manifests edited behind the store's back: the engine re-runs the checks and exits 2."""
    home = drafter_home
    src = json.loads((home / "models" / TINY / "manifest.json").read_text())
    bad_draft = {"kind": "draft", "name": "big-vocab", "path": "big-vocab", "config": {}}
    craft(home, TINY, "tiny-bad-draft", top={"drafters": [bad_draft]})
    craft(home, TINY, "tiny-bad-mtp")
    folder = home / "models" / "tiny-bad-mtp" / "drafters" / "head"
    folder.mkdir(parents=True)
    shutil.copyfile(head, folder / "mtp.safetensors")
    shutil.copyfile(config_path(head), folder / "mtp.json")
    from pie_runtime.paths import sha256_file

    manifest = json.loads((home / "models" / "tiny-bad-mtp" / "manifest.json").read_text())
    manifest["files"] |= {f"drafters/head/{f}": sha256_file(folder / f) for f in ("mtp.safetensors", "mtp.json")}
    manifest["drafters"] = [{"kind": "mtp", "name": "head", "path": "drafters/head/mtp.safetensors", "config": {}}]
    (home / "models" / "tiny-bad-mtp" / "manifest.json").write_text(json.dumps(manifest))
    assert src["drafters"] == []
    for name, why in (("tiny-bad-draft", "larger than"), ("tiny-bad-mtp", "hidden size")):
        with pytest.raises(DrafterRefused, match=why):
            check_attached(store(home), store(home).get(name))
        before = snapshot(home)
        with pytest.raises(LaunchError, match=why):
            start_engine(home, [name])
        assert snapshot(home) == before
    for name in ("tiny-bad-draft", "tiny-bad-mtp"):
        store(home).remove(name)


def test_engine_exit_code_is_2(drafter_home):
    craft(
        drafter_home,
        TINY,
        "tiny-bad-exit",
        top={"drafters": [{"kind": "draft", "name": "recurrent", "path": "recurrent", "config": {}}]},
    )
    proc = pie(drafter_home, "engine", "--model", "tiny-bad-exit", "--listen", "ipc:///tmp/pie-never.sock", check=False)
    store(drafter_home).remove("tiny-bad-exit")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: draft model 'recurrent' keeps recurrent state")


# ---- attach, detach, digests ------------------------------------------------------------------------------------


def test_attach_detach_and_digest_check(drafter_home, head):
    home = drafter_home
    link_model(home / "models" / DEFAULT_MODEL, home / "models" / "smol-copy")
    manifest = json.loads((home / "models" / "smol-copy" / "manifest.json").read_text())
    manifest["name"] = "smol-copy"
    (home / "models" / "smol-copy" / "manifest.json").write_text(json.dumps(manifest))
    s = store(home)
    pie(home, "model", "drafter", "attach", "smol-copy", f"mtp:{head}", "--as", "h")
    m = s.get("smol-copy")
    assert [(d.kind, d.name) for d in m.drafters] == [("mtp", "h")]
    assert "drafters/h/mtp.safetensors" in m.files and "drafters/h/mtp.json" in m.files
    info = pie(home, "model", "info", "smol-copy").stdout
    assert "h  mtp  drafters/h/mtp.safetensors" in info
    with pytest.raises(DrafterRefused, match="already has a drafter"):
        attach(s, "smol-copy", f"mtp:{head}", "h")
    # the copied head is digest-checked like the weights
    path = home / "models" / "smol-copy" / "drafters" / "h" / "mtp.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(StoreIntegrityError, match="mtp.safetensors"):
        s.verify("smol-copy")
    pie(home, "model", "drafter", "detach", "smol-copy", "h")
    m = s.get("smol-copy")
    assert m.drafters == [] and not any(f.startswith("drafters/") for f in m.files)
    assert not (home / "models" / "smol-copy" / "drafters" / "h").exists()
    with pytest.raises(StoreError, match="has no drafter"):
        detach(s, "smol-copy", "h")
    s.remove("smol-copy")


def test_trained_files(drafter_home, head):
    cfg = read_config(head)
    target = store(drafter_home).get(DEFAULT_MODEL)
    assert cfg.target_digest == target.files["model.safetensors"] and cfg.depth == 2 and cfg.shared
    draft = store(drafter_home).get(DRAFT)
    assert draft.config.num_hidden_layers == 2 and draft.files["tokenizer.json"] == target.files["tokenizer.json"]


def test_a_heads_recorded_acceptance_is_read_only_where_it_is_probabilities():
    assert heldout_acceptance({"heldout_acceptance": [0.61, 0.5]}) == [0.61, 0.5]
    for odd in ({}, {"heldout_acceptance": "0.6"}, {"heldout_acceptance": [0.6, 1.5]}, {"heldout_acceptance": [None]}):
        assert heldout_acceptance(odd) == []  # a hand-written record: no prior rather than a wrong one


# ---- weight formats of draft models ---------------------------------------------------------------------------


def test_served_formats_by_attachment_and_flag(drafter_home, head):
    s = store(drafter_home)
    with pytest.raises(DrafterRefused, match="for a draft model"):
        attach(s, DEFAULT_MODEL, f"mtp:{head}", "fmt-head", weights="int8")
    attach(s, DEFAULT_MODEL, f"draft:{DRAFT}", "fmt-draft", weights="int8")
    try:
        assert served_formats(s, [DEFAULT_MODEL], "int4", {}) == {DEFAULT_MODEL: "int4", DRAFT: "int8"}
        assert served_formats(s, [DEFAULT_MODEL, DRAFT], "fp32", {})[DRAFT] == "int8"  # named: still its own
        chosen = {DRAFT: "bf16", DEFAULT_MODEL: "fp32"}
        assert served_formats(s, [DEFAULT_MODEL], "int4", chosen) == chosen  # the flag wins
        with pytest.raises(ValueError, match="does not serve 'nope'"):
            served_formats(s, [DEFAULT_MODEL], "int4", {"nope": "int8"})
        proc = pie(drafter_home, "model", "info", DEFAULT_MODEL)
        assert "fmt-draft  draft  smol-draft  served in int8" in proc.stdout
    finally:
        detach(s, DEFAULT_MODEL, "fmt-draft")
    assert served_formats(s, [DEFAULT_MODEL], "int4", {}) == {DEFAULT_MODEL: "int4"}
    assert served_formats(s, [DEFAULT_MODEL], None, {}) == {DEFAULT_MODEL: DEFAULT_WEIGHTS}  # Q4_1 + Q8_0: int4


def test_a_model_with_kinds_int4_would_requantize_runs_in_gguf_by_default():
    """Gemma 3 270M's Q4_K_M requantized to int4 keeps the float32 reference's top-1 at under three quarters of
    positions (tests/models/test_gemma3_270m.py checks the default's): kinds int4 runs as stored keep int4."""
    assert default_format(["q4_1", "q8_0"]) == DEFAULT_WEIGHTS == "int4"
    assert default_format([]) == "int4"  # a float model
    assert default_format(["q4_k", "q6_k", "q8_0"]) == "gguf"
    assert default_format(["q5_0", "q8_0"]) == "gguf"


def test_weights_flag_words():
    p = argparse.ArgumentParser()
    add_engine_options(p)
    args = p.parse_args(["--weights", "int8", "--weights", "smol-draft=bf16"])
    assert named_format(args) == "int8" and model_weights(args) == {"smol-draft": "bf16"}
    assert weights_words(args) == ["--weights", "int8", "--weights", "smol-draft=bf16"]
    none = p.parse_args([])  # each model in its own default (formats.default_format), decided by the engine
    assert named_format(none) is None and model_weights(none) == {} and weights_words(none) == []
    for bad in ("int3", "smol-draft=", "=int8", "smol-draft=q4"):
        with pytest.raises(SystemExit):
            p.parse_args(["--weights", bad])


# ---- serving ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(drafter_home, head):
    """The default model with the trained MTP head and draft model attached, in a real engine."""
    s = store(drafter_home)
    attach(s, DEFAULT_MODEL, f"mtp:{head}", "head")
    attach(s, DEFAULT_MODEL, f"draft:{DRAFT}", weights="bf16")  # the engine's --weights is fp32
    eng = start_engine(drafter_home, [DEFAULT_MODEL])
    yield eng
    eng.stop()
    detach(s, DEFAULT_MODEL, "head")
    detach(s, DEFAULT_MODEL, DRAFT)


@pytest.fixture
def heldout_ids(drafter_home):
    from tokenizers import Tokenizer

    text = (drafter_home / "corpus.txt").read_text()[-3000:]
    tok = Tokenizer.from_file(str(drafter_home / "models" / DEFAULT_MODEL / "tokenizer.json"))
    return tok.encode(text).ids[:96]


@pytest.fixture
async def served_model(served):
    """An SDK session on the served engine, yielding the default model's handle."""
    session = await inferlet.connect(served.address)
    yield inferlet.model()
    session.client.close()


async def test_mtp_readout_through_engine(served_model, heldout_ids, head):
    m = served_model
    assert m.mtp_depth == 2
    recorded = read_config(head).training["heldout_acceptance"]  # what `pie drafter train` measured
    assert m.mtp_acceptance == recorded and len(recorded) == 2 and all(0 <= a <= 1 for a in recorded)
    assert {d["name"] for d in m.drafters} == {"head", DRAFT}
    ids = heldout_ids
    rows = list(range(len(ids)))
    fp = inferlet.ForwardPass(m.working_set())
    fp.embed(ids)
    fp.readout(rows, inferlet.Argmax())
    fp.readout(rows, inferlet.MTP(k=2))
    res = await fp.submit()
    greedy, mtp = res.readouts[0].tokens, res.readouts[1].tokens
    assert mtp.shape == (len(ids), 3) and mtp.dtype == np.int32
    assert (mtp[:, 0] == greedy).all()
    # draft 1 at row i proposes the token after greedy[i]; where the text follows the target's choice,
    # the target's own next choice is greedy[i + 1]
    follows = [i for i in range(len(ids) - 1) if ids[i + 1] == greedy[i]]
    agree = np.mean([mtp[i, 1] == greedy[i + 1] for i in follows])
    assert len(follows) > 10 and agree > 0.1, agree  # chance is 1 / 49152

    fp = inferlet.ForwardPass(m.working_set())
    fp.embed(ids[:8]).readout([7], inferlet.MTP(k=2, with_probs=True))
    res = await fp.submit()
    assert res.tokens.shape == (1, 3) and res.probs.shape == (1, 2, m.vocab_size)
    assert np.allclose(res.probs.sum(-1), 1.0, atol=1e-4)
    assert (res.probs[0].argmax(-1) == res.tokens[0, 1:]).all()

    with pytest.raises(inferlet.PieError, match="depth"):
        fp = inferlet.ForwardPass(m.working_set())
        await fp.embed(ids[:4]).readout([3], inferlet.MTP(k=3)).submit()


async def test_mtp_at_accepted_chains_only_from_the_verifier_row(served_model, heldout_ids):
    m = served_model
    ids = heldout_ids
    fp = inferlet.ForwardPass(m.working_set()).embed(ids).readout(range(len(ids)), inferlet.Argmax())
    greedy = (await fp.submit()).tokens
    # a window of 5 rows whose first rows follow the target's greedy choice (so it accepts some)
    runs = [next((n for n in range(4) if greedy[s + n] != ids[s + n + 1]), 4) for s in range(len(ids) - 5)]
    start = int(np.argmax(runs))
    rows = list(range(start, start + 5))
    fp = inferlet.ForwardPass(m.working_set()).embed(ids[: start + 5])
    fp.readout(rows, inferlet.MTP(k=2)).readout(rows, inferlet.MTP(k=2, at_accepted=True))
    res = await fp.submit()
    full, at = res.readouts[0].tokens, res.readouts[1].tokens
    n = runs[start]
    assert n > 0 and (at[:, 0] == full[:, 0]).all()
    assert (at[n, 1:] == full[n, 1:]).all()
    assert (np.delete(at[:, 1:], n, axis=0) == -1).all()

    refused = [
        ([4, 5], inferlet.MTP(k=1, with_probs=True, at_accepted=True)),  # sampled: host decides
        ([1, 3], inferlet.MTP(k=1, at_accepted=True)),
    ]  # rows that are not one stretch
    for bad_rows, kind in refused:
        fp = inferlet.ForwardPass(m.working_set()).embed(ids[:6]).readout(bad_rows, kind)
        with pytest.raises(inferlet.PieError, match="at_accepted"):
            await fp.submit()


async def test_mtp_first_column_obeys_the_mask(served_model, heldout_ids):
    m = served_model
    allowed = [42, 1000]
    mask = np.zeros((1, (m.vocab_size + 31) // 32), dtype=np.uint32)
    for t in allowed:
        mask[0, t // 32] |= np.uint32(1 << (t % 32))
    fp = inferlet.ForwardPass(m.working_set())
    fp.embed(heldout_ids[:6]).readout([5], inferlet.MTP(k=1), mask=mask.view(np.int32))
    res = await fp.submit()
    assert res.tokens[0, 0] in allowed


async def test_draft_model_is_served_by_name(served_model, heldout_ids):
    target, draft = served_model, inferlet.model(DRAFT)
    assert draft.vocab_size == target.vocab_size and draft.mtp_depth == 0
    assert (target.info.weights, draft.info.weights) == ("fp32", "bf16")  # the attachment's own format
    ids = heldout_ids
    out = []
    for m in (target, draft):
        fp = inferlet.ForwardPass(m.working_set())
        fp.embed(ids).readout(list(range(len(ids))), inferlet.Argmax())
        out.append((await fp.submit()).tokens)
    assert np.mean(out[0] == out[1]) > 0.02  # 2 layers trained for seconds; chance is 1 / 49152
