"""The shipped speculative inferlets, unchanged, on models with recurrent state: a real engine serving a tiny
random Mamba or LFM2 (imported from its Hugging Face folder) beside a tiny random Llama that shares its
tokenizer (the draft model), under either way the engine folds fewer rows than ran (``--recurrent-fold``:
per-row states or replay). Greedy output equals text-completion's token for token (cacheback host- and
device-verified, the draft model, constrained against its own plain masked decode), the runs count the rows
the engine replayed (none where per-row states served every fold), and the prefix cache is off for these
models."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from pie_runtime.store import ModelStore, import_model
from tests.conftest import start_engine
from tests.inferlets.conftest import call_many
from tests.models.tiny_models import RECURRENT_FAMILIES, write_tiny_checkpoint

pytestmark = pytest.mark.e2e

# prompts whose greedy continuations have no near-tie (top-2 logit margin above 2e-3 on both tiny models):
# fp32 passes of different widths differ in the last bits, which an exact tie would turn into another token
PROMPTS = [
    {"prompt": "the cat sat on the mat, the cat sat on the"},
    {"prompt": "hello world"},
    {"prompt": "def f(x): return x"},
]
MAX = 20
DRAFT = "tiny-llama"


@dataclass(frozen=True)
class RecurrentEngine:
    address: str
    fold: str  # the engine's --recurrent-fold


@pytest.fixture(scope="module", params=[(f, fold) for f in RECURRENT_FAMILIES for fold in ("per-row", "replay")])
def recurrent_engine(request, tmp_path_factory):
    """An engine serving ``tiny-<family>`` (the default model) and the Llama draft, from a private store."""
    family, fold = request.param
    root = tmp_path_factory.mktemp(f"recurrent-{family}")
    home = root / "home"
    for fam in (family, "llama"):
        write_tiny_checkpoint(root / fam, fam)
        import_model(str(root / fam), name=f"tiny-{fam}", store=ModelStore(home / "models"), progress=False)
    flags = ["--state-slots", "16", "--pass-cost-rows", "8", "--recurrent-fold", fold]
    eng = start_engine(Path(home), [f"tiny-{family}", DRAFT], *flags)
    yield RecurrentEngine(eng.address, fold)
    eng.stop()


def runs(engine, name: str, extra: dict) -> list[dict]:
    return call_many(engine.address, name, [{**p, "max_tokens": MAX, "ignore_eos": True, **extra} for p in PROMPTS])


def test_speculative_inferlets_equal_text_completion(recurrent_engine):
    want = [r["token_ids"] for r in runs(recurrent_engine, "text-completion", {})]
    # the loop left with the engine (a run-ahead: channel-fed windows, epilogue folds) decodes the same
    assert [r["token_ids"] for r in runs(recurrent_engine, "text-completion", {"run_ahead": True})] == want
    replayed, rejecting = 0, 0.0
    for name, extra in [
        ("cacheback-speculative-decoding", {"draft_schedule": "fixed", "draft_length": 4}),
        ("cacheback-speculative-decoding", {"device_verify": True, "draft_schedule": "fixed"}),
        ("draft-model-speculative-decoding", {"draft": DRAFT, "draft_schedule": "fixed", "draft_length": 3}),
    ]:
        got = runs(recurrent_engine, name, extra)
        assert [r["token_ids"] for r in got] == want, (name, extra)
        stats = [r["stats"] for r in got]
        assert sum(s["proposed"] for s in stats) > 0, (name, extra)
        replayed += sum(s["replayed_rows"] for s in stats)
        share = sum(s["rejecting_round_share"] for s in stats)
        rejecting += share
        if recurrent_engine.fold == "replay" and share and not extra.get("device_verify"):
            assert sum(s["replayed_rows"] for s in stats) > 0, (name, extra)
    assert rejecting > 0
    # per-row states (8 a working set) serve every fold of these windows of at most 5 rows: nothing replays
    assert replayed == 0 if recurrent_engine.fold == "per-row" else replayed > 0


def test_constrained_equals_its_plain_masked_decode(recurrent_engine):
    regex = {"regex": "(the |cat |sat |on |mat |hello |world )+"}
    plain = runs(recurrent_engine, "constrained-speculative-decoding", {**regex, "draft_length": 0})
    spec = runs(recurrent_engine, "constrained-speculative-decoding", regex)
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert sum(r["stats"]["proposed"] for r in spec) > 0


def test_the_engine_reports_its_state_pool(recurrent_engine):
    import asyncio

    import inferlet

    async def go():
        session = await inferlet.connect(recurrent_engine.address)
        try:
            model = inferlet.model()
            stats = await model.client.request("stats")
            return model, stats
        finally:
            session.client.close()

    model, stats = asyncio.run(go())
    assert model.recurrent and model.info.state_slots == 16 and model.state_granule == 1
    assert model.info.recurrent_fold == recurrent_engine.fold
    assert model.per_row_states == (8 if recurrent_engine.fold == "per-row" else 0)
    assert model.info.family in RECURRENT_FAMILIES and model.info.state_bytes > 0
    assert stats["models"][model.name]["prefix_cache"]["enabled"] is False
    assert stats["models"][model.name]["state_slots"] == {"used": 0, "total": 16}


def random_mtp_head(store: ModelStore, model: str, folder: Path, depth: int = 2) -> Path:
    """A stateless MTP head of random weights bound to ``model`` (its drafts are mostly wrong, which is what
    exactness needs tested: the rounds that reject)."""
    import torch

    from pie_runtime.drafters import target_digest
    from pie_runtime.models.mtp import MTPConfig, MTPModule, save_mtp

    target = store.get(model)
    cfg = MTPConfig(
        hidden_size=target.config.hidden_size,
        intermediate_size=2 * target.config.hidden_size,
        num_blocks=1,
        depth=depth,
        vocab_size=target.config.vocab_size,
        target=model,
        target_digest=target_digest(target),
    )
    torch.manual_seed(1)
    module = MTPModule(cfg)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    path = folder / "head.safetensors"
    save_mtp(module, path)
    return path


@pytest.fixture(scope="module", params=RECURRENT_FAMILIES)
def mtp_engine(request, tmp_path_factory):
    """An engine serving ``tiny-<family>`` with a random MTP head attached (``pie model drafter attach``)."""
    from pie_runtime.drafters import attach

    family = request.param
    root = tmp_path_factory.mktemp(f"mtp-{family}")
    home = root / "home"
    store = ModelStore(home / "models")
    write_tiny_checkpoint(root / family, family)
    import_model(str(root / family), name=f"tiny-{family}", store=store, progress=False)
    attach(store, f"tiny-{family}", f"mtp:{random_mtp_head(store, f'tiny-{family}', root)}")
    eng = start_engine(Path(home), [f"tiny-{family}"], "--state-slots", "16", "--pass-cost-rows", "8")
    yield eng
    eng.stop()


def test_mtp_speculation_equals_text_completion(mtp_engine):
    """The MTP head carries no state: on a recurrent target it reads the target's last hidden state per row
    and the shared embedding, norm and lm head, and every round's fold restores the target's state."""
    want = [r["token_ids"] for r in runs(mtp_engine, "text-completion", {})]
    for extra in ({"draft_length": 2, "draft_schedule": "fixed"}, {"draft_length": 2, "run_ahead": True}):
        got = runs(mtp_engine, "mtp-speculative-decoding", extra)
        assert [r["token_ids"] for r in got] == want, extra
        assert sum(r["stats"]["proposed"] for r in got) > 0, extra
