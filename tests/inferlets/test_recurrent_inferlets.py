"""The shipped speculative inferlets, unchanged, on models with recurrent state: a real engine serving a tiny
random Mamba or LFM2 (imported from its Hugging Face folder) beside a tiny random Llama that shares its
tokenizer (the draft model), under either way the engine folds fewer rows than ran (``--recurrent-fold``:
per-row states or replay). Greedy output equals text-completion's token for token (cacheback host- and
device-verified, the draft model, constrained against its own plain masked decode), the runs count the rows
the engine replayed (none where per-row states served every fold), and the prefix cache is off for these
models."""

from __future__ import annotations

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
    eng.fold = fold
    yield eng
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
        rejecting += sum(s["rejecting_round_share"] for s in stats)
        if recurrent_engine.fold == "replay" and rejecting and not extra.get("device_verify"):
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
