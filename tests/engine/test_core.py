"""The engine core in process, without sockets: requests go through the protocol's parser to
``EngineCore.handle`` and ``EngineCore.step``, on a tiny random Llama with a small paged KV pool.

Scheduling order, chunked prefill, copy-on-write fork and truncate, release on departure and a full pool;
the end-to-end tests (test_engine_e2e.py) cover the same over real sockets and processes."""

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
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.llama import LlamaForCausalLM
from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol import messages as m
from pie_runtime.protocol.arrays import decode_array
from pie_runtime.protocol.codec import pack, parse_request

VOCAB, PAGE = 97, 4
A, B = b"client-a", b"client-b"


def tiny_served_model(num_pages: int) -> ServedModel:
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
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    kv = KVCache(cfg, num_pages, PAGE, torch.float32)
    runner = ModelRunner(model, kv, torch.device("cpu"))
    info = m.ModelInfo(
        name="tiny",
        vocab_size=VOCAB,
        max_positions=128,
        page_size=PAGE,
        bos_token_id=None,
        eos_token_ids=[],
        chat_template=None,
    )
    return ServedModel(
        "tiny", info, runner, KVPages(PagePool(num_pages), PAGE, runner.copy_pages, runner.copy_slots), "{}"
    )


class Core:
    """An engine core and a request counter: ``call`` for requests answered at once, ``fire`` + ``step``."""

    def __init__(self, num_pages: int = 32, max_batch_tokens: int = 256):
        self.core = EngineCore([tiny_served_model(num_pages)], max_batch_tokens)
        self.ids = iter(range(1, 1_000_000))

    def request(self, client: bytes, op: str, **fields) -> tuple[int, dict | None]:
        req_id = next(self.ids)
        _, req = parse_request(pack({"id": req_id, "op": op, **fields}))
        return req_id, self.core.handle(client, req)

    def call(self, client: bytes, op: str, **fields) -> dict:
        _, reply = self.request(client, op, **fields)
        assert reply is not None
        return reply

    def fire(self, client: bytes, ws: int, tokens: list[int], **fields) -> int:
        req_id, reply = self.request(client, "fire", ws=ws, tokens=tokens, **fields)
        assert reply is None  # answered by a step
        return req_id

    def step(self) -> dict[int, dict]:
        return {reply["id"]: reply for _, reply in self.core.step()}

    def run(self) -> dict[int, dict]:
        """Steps until no fire is left; every reply by request id."""
        replies: dict[int, dict] = {}
        while self.core.has_work():
            replies.update(self.step())
        return replies

    def pages_free(self) -> int:
        return self.call(A, "stats")["models"]["tiny"]["pages_free"]


def logits_of(reply: dict) -> np.ndarray:
    assert reply["ok"], reply
    return decode_array(reply["results"][0]["logits"])


PROMPT = [(7 * i + 3) % VOCAB for i in range(30)]


def test_every_wire_op_has_a_handler():
    assert set(Core().core.ops) == set(m.REQUEST_OPS)


def test_decode_fires_run_before_a_long_prefill_and_a_working_sets_fires_in_order():
    c = Core(max_batch_tokens=8)
    long_ws = c.call(A, "ws_open")["ws"]
    short_ws = c.call(B, "ws_open")["ws"]
    prefill = c.fire(A, long_ws, PROMPT)
    first = c.fire(B, short_ws, [5])
    second = c.fire(B, short_ws, [6])
    step1 = c.step()
    assert set(step1) == {first}  # the one-row fire ran whole, the prefill took the other 7 rows
    assert c.core.stats.rows == 8
    step2 = c.step()
    assert set(step2) == {second}  # the working set's second fire waited for its first
    assert step2[second]["committed"] == 2
    replies = c.run()
    assert set(replies) == {prefill} and replies[prefill]["committed"] == len(PROMPT)


def test_chunked_prefill_equals_one_pass():
    rows = list(range(len(PROMPT)))
    whole, chunked = Core(max_batch_tokens=256), Core(max_batch_tokens=7)
    out = []
    for c in (whole, chunked):
        ws = c.call(A, "ws_open")["ws"]
        req = c.fire(A, ws, PROMPT, readouts=[{"rows": rows, "kind": "logits"}])
        out.append(logits_of(c.run()[req]))
    assert chunked.core.stats.steps == -(-len(PROMPT) // 7)
    np.testing.assert_allclose(out[1], out[0], rtol=1e-4, atol=1e-4)


def test_fork_shares_pages_copies_on_write_and_truncate_returns_them():
    c = Core(num_pages=32)
    parent = c.call(A, "ws_open")["ws"]
    c.fire(A, parent, PROMPT[:18])  # 5 pages, the last holding 2 rows
    c.run()
    assert c.pages_free() == 32 - 5
    child = c.call(A, "ws_fork", ws=parent)
    assert child["committed"] == 18
    assert c.pages_free() == 32 - 5  # shared, not copied
    # the same next token on both sides: the child's first write copies the shared tail page
    logits = []
    for ws in (child["ws"], parent):
        req = c.fire(A, ws, [11], readouts=[{"rows": [0], "kind": "logits"}])
        logits.append(logits_of(c.run()[req]))
        assert c.pages_free() == 32 - 6
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    # the child diverges; the parent still reads its own rows
    c.fire(A, child["ws"], [12, 13])
    c.run()
    after = c.fire(A, parent, [14], readouts=[{"rows": [0], "kind": "logits"}])
    fresh = Core(num_pages=32)
    ws = fresh.call(A, "ws_open")["ws"]
    ref = fresh.fire(A, ws, PROMPT[:18] + [11, 14], readouts=[{"rows": [19], "kind": "logits"}])
    np.testing.assert_allclose(logits_of(c.run()[after]), logits_of(fresh.run()[ref]), rtol=1e-4, atol=1e-4)
    # the child holds 6 pages: 4 shared with the parent, its copy of the tail page and one new page.
    # Truncated to 10 rows it keeps 3: its own two go back, the shared fourth stays with the parent.
    free = c.pages_free()
    assert c.call(A, "ws_truncate", ws=child["ws"], n=10) == {"committed": 10}
    assert c.pages_free() == free + 2


def test_release_on_departure_returns_everything():
    c = Core(num_pages=16)
    ws = c.call(A, "ws_open")["ws"]
    c.fire(A, ws, PROMPT[:9])
    c.run()
    ch = c.call(A, "channel_open", shape=[1], dtype="int32", capacity=2)["channel"]
    c.fire(A, ws, [1, 2, 3], fold=m.DEFERRED)  # queued, never run
    other = c.call(B, "ws_open")["ws"]
    c.fire(B, other, [4])
    assert c.pages_free() < 16
    assert c.core.drop_client(A) == 1
    stats = c.call(B, "stats")
    assert stats["working_sets"] == 1 and stats["channels"] == 0
    replies = c.run()
    assert [r["ok"] for r in replies.values()] == [True]  # only B's fire is answered
    assert c.pages_free() == 16 - 1
    with pytest.raises(PieError) as e:
        c.call(A, "channel_read", channel=ch)
    assert e.value.code == ErrorCode.UNKNOWN_CHANNEL


def test_a_full_pool_refuses_a_fire_and_changes_nothing():
    c = Core(num_pages=4)  # 16 rows in all
    ws = c.call(A, "ws_open")["ws"]
    c.fire(A, ws, PROMPT[:10], fold=m.DEFERRED)
    c.run()
    assert c.pages_free() == 1
    other = c.call(B, "ws_open")["ws"]
    with pytest.raises(PieError) as e:
        c.request(B, "fire", ws=other, tokens=PROMPT[:8])
    assert e.value.code == ErrorCode.OUT_OF_PAGES
    # a refused fire that would have settled a deferred fold leaves the fold pending
    with pytest.raises(PieError) as e:
        c.request(A, "fire", ws=ws, tokens=PROMPT[:12], settle=10)
    assert e.value.code == ErrorCode.OUT_OF_PAGES
    assert c.call(A, "stats")["models"]["tiny"]["queued"] == 0
    assert c.pages_free() == 1
    assert c.call(A, "ws_fold", ws=ws, n=4) == {"committed": 4}  # still settleable
    assert c.pages_free() == 3  # the unfolded rows' pages came back
