"""Eagle(k) readouts through the engine core on a tiny random target with a random EAGLE head: the draft
layer's K/V live in the pool's extra layer and each working set's feature tail carries the feature of its
last row across fires (and into a fork), so a prompt run as one fire or as several gives the same draft
distributions; at_accepted chains from the row greedy verification stops at; admission refuses what the
model cannot serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pie_runtime.engine.core import EngineCore
from pie_runtime.engine.kv_pages import KVPages
from pie_runtime.engine.page_pool import PagePool
from pie_runtime.engine.runner import ModelRunner
from pie_runtime.engine.served import ServedModel
from pie_runtime.models.config import ModelConfig
from pie_runtime.models.eagle import EagleConfig, EagleHead, EagleModule
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.llama import LlamaForCausalLM
from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol import messages as m
from pie_runtime.protocol.arrays import decode_array
from tests.engine.test_core import A, Core, tiny_served_model

VOCAB, PAGE, DEPTH = 64, 4, 3
PROMPT = [5, 9, 13, 2, 44, 17, 8, 30, 21, 3, 60, 12]


def eagle_served_model(num_pages: int = 32) -> ServedModel:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(cfg).eval()
    module = EagleModule(EagleConfig.for_target(cfg, DEPTH, "tiny", "x" * 64))
    with torch.no_grad():
        for p in [*model.parameters(), *module.parameters()]:
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    kv = KVCache(cfg, num_pages, PAGE, torch.float32, extra_layers=1)
    runner = ModelRunner(model, kv, torch.device("cpu"))
    runner.eagle = EagleHead(module.eval(), model)
    info = m.ModelInfo(
        name="tiny",
        vocab_size=VOCAB,
        max_positions=128,
        page_size=PAGE,
        bos_token_id=None,
        eos_token_ids=[],
        chat_template=None,
        eagle_depth=DEPTH,
    )
    return ServedModel("tiny", info, runner, KVPages(PagePool(num_pages), PAGE, runner.copy_pages), "{}")


class EagleCore(Core):
    def __init__(self):
        self.core = EngineCore([eagle_served_model()], 256)
        self.ids = iter(range(1, 1_000_000))


def eagle(rows: list[int], **fields) -> dict:
    return {"rows": rows, "kind": "eagle", "k": DEPTH, **fields}


def probs_after(c: EagleCore, fires: list[list[int]], fork_before_last: bool = False) -> np.ndarray:
    """Runs ``fires`` on one working set (each folded whole), the last with an Eagle readout with probs at its
    last row; with ``fork_before_last`` the last fire runs on a fork. Returns (k, V) draft distributions."""
    ws = c.call(A, "ws_open")["ws"]
    for tokens in fires[:-1]:
        c.fire(A, ws, tokens)
        c.run()
    if fork_before_last:
        ws = c.call(A, "ws_fork", ws=ws)["ws"]
    last = fires[-1]
    req = c.fire(A, ws, last, readouts=[eagle([len(last) - 1], with_probs=True)])
    reply = c.run()[req]
    assert reply["ok"], reply
    return decode_array(reply["results"][0]["probs"])[0]


def test_the_drafts_do_not_depend_on_how_the_sequence_was_fired():
    whole = probs_after(EagleCore(), [PROMPT])
    assert whole.shape == (DEPTH, VOCAB)
    for fires, fork in (([PROMPT[:5], PROMPT[5:]], False), ([PROMPT[:3], PROMPT[3:9], PROMPT[9:]], True)):
        np.testing.assert_allclose(probs_after(EagleCore(), fires, fork), whole, rtol=1e-4, atol=1e-5)


def test_at_accepted_chains_from_the_row_greedy_verification_stops_at():
    c = EagleCore()
    ws = c.call(A, "ws_open")["ws"]
    req = c.fire(A, ws, PROMPT, readouts=[eagle(list(range(len(PROMPT))))])
    every = decode_array(c.run()[req]["results"][0]["tokens"])  # (R, 1+k) chained from every row
    greedy = every[:, 0]
    # a window whose first two "drafts" are the target's greedy tokens and whose third is not
    window = [PROMPT[0], int(greedy[0])]
    ws2 = c.call(A, "ws_open")["ws"]
    req = c.fire(A, ws2, window, readouts=[eagle([0, 1])])
    chained = decode_array(c.run()[req]["results"][0]["tokens"])
    c3 = c.call(A, "ws_open")["ws"]
    req = c.fire(A, c3, window, readouts=[eagle([0, 1], at_accepted=True)])
    acc = decode_array(c.run()[req]["results"][0]["tokens"])
    assert (acc[:, 0] == chained[:, 0]).all()
    assert (acc[1, 1:] == chained[1, 1:]).all() and (acc[0, 1:] == -1).all()  # row 0 agreed: chain from row 1


def test_admission_refuses_what_the_model_cannot_serve():
    plain = Core()
    ws = plain.call(A, "ws_open")["ws"]
    with pytest.raises(PieError, match="no EAGLE drafter") as e:
        plain.request(A, "fire", ws=ws, tokens=[1, 2], readouts=[{"rows": [1], "kind": "eagle", "k": 1}])
    assert e.value.code == ErrorCode.UNSUPPORTED
    c = EagleCore()
    ws = c.call(A, "ws_open")["ws"]
    with pytest.raises(PieError, match="past the drafter's depth"):
        c.request(A, "fire", ws=ws, tokens=[1, 2], readouts=[eagle([1], k=DEPTH + 1)])


def test_tiny_served_model_still_builds_without_a_head():
    assert tiny_served_model(8).runner.eagle is None
