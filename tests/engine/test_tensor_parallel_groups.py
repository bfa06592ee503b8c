"""Tensor parallelism with KV page groups (issue 56): a random Gemma-3-shaped checkpoint (sliding layers of window
16 beside global ones, two KV heads so two ranks split them) imported from a Hugging Face folder, served with
``--tensor-parallel 2`` and with one rank, both with page groups (the sliding layers let go of their rows), and
one rank with ``--kv-swa-full``. Greedy decoding over a prompt and 80 steps, far past the window, with an eviction
midway: the same tokens, float32 logits within 1e-4 of one rank's; each rank's sliding groups stay within the
window's pages, and every page is back when the working set is released."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import inferlet
from tests.conftest import home_with_checkpoint, start_engine

pytestmark = pytest.mark.e2e

NAME, WINDOW, PAGE = "tiny-gemma3-swa", 16, 4
PROMPT = [2, 420, 77, 3141, 5926, 535, 8979, 3238, 4626, 4338, 99, 1024, 7, 77, 420, 5926, 11, 12, 13, 14, 15]


def write_tiny_gemma3(folder: Path, tokenizer_json: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    cfg = transformers.Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        sliding_window=WINDOW,
        layer_types=types,
        query_pre_attn_scalar=16,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # random norms too (Gemma's start at zero: 1 + w), so every weight takes part
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    shutil.copy(tokenizer_json, folder / "tokenizer.json")


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return home_with_checkpoint(tmp_path_factory, "pie-home-tp-gemma", NAME, write_tiny_gemma3)


async def greedy(address: str, steps: int = 80, evict_at: int = 40) -> tuple[list[int], np.ndarray, list[list]]:
    """Greedy steps with their logits and the page groups' pages after each; ``evict_at`` steps in, rows
    30..34 are evicted (each rank's shard moves the rows after them, in every group that still holds them)."""
    session = await inferlet.connect(address)
    try:
        model = inferlet.model(NAME)
        ws = model.working_set()
        window, tokens, rows, held = list(PROMPT), [], [], []
        for step in range(steps):
            if step == evict_at:
                await ws.evict(ranges=[(30, 35)])
            fp = inferlet.ForwardPass(ws)
            fp.embed(window).readout([len(window) - 1], inferlet.Logits())
            logits = (await fp.submit()).logits
            assert logits is not None
            rows.append(logits[0])
            tokens.append(int(np.argmax(logits[0])))
            window = [tokens[-1]]
            groups = (await model.client.request("stats"))["models"][NAME]["page_groups"]
            held.append([(g["window"], g["pages"]) for g in groups])
        await ws.release()
        s = (await model.client.request("stats"))["models"][NAME]
        assert s["pages_free"] == s["pages_total"]
        return tokens, np.stack(rows), held
    finally:
        session.client.close()


async def test_two_ranks_with_page_groups_equal_one_rank_and_all_rows(home):
    flags = ("--threads", "1", "--pass-cost-rows", "0", "--page-size", str(PAGE))
    one = start_engine(home, [NAME], *flags)
    two = start_engine(home, [NAME], *flags, "--tensor-parallel", "2")
    full = start_engine(home, [NAME], *flags, "--kv-swa-full")
    try:
        tokens1, logits1, held1 = await greedy(one.address)
        tokens2, logits2, held2 = await greedy(two.address)
        tokens3, logits3, _ = await greedy(full.address)
    finally:
        one.stop()
        two.stop()
        full.stop()
    assert tokens2 == tokens1 == tokens3
    assert logits2.shape == logits1.shape == (80, 49152)
    assert float(np.abs(logits2 - logits1).max()) < 1e-4
    assert np.array_equal(logits1, logits3)  # one rank: page groups give the all-rows engine's bits
    assert held2 == held1  # the ranks keep rank 0's page tables: the same pages per group
    windows = {w for step in held2 for w, _ in step}
    assert windows == {None, WINDOW}
    for step in held2:
        for window, pages in step:
            if window is not None:
                assert pages <= WINDOW // PAGE + 2
