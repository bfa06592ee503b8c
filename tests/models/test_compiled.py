"""The whole decoder compiled as one graph (models/compiled.py, the engine's ``--compile``): a verify window's rows
get the bits 1-row passes give them, as in eager, and the logits stay eager's up to where bf16 rounds."""

from __future__ import annotations

import torch

from pie_runtime.models.compiled import compile_decoder
from pie_runtime.models.context import ForwardContext, Segment
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.weights import ACTIVATION_DTYPE
from tests.models.test_weights import PAGE, prepared
from tests.models.tiny_models import TINY_VOCAB


def test_a_compiled_decoder_keeps_rows_batch_invariant_and_close_to_eager(tiny_store):
    store, _ = tiny_store
    eager, model = prepared("tiny-llama", "int4", store), prepared("tiny-llama", "int4", store)
    compile_decoder(model)
    ids = torch.randint(0, TINY_VOCAB, (40,), generator=torch.Generator().manual_seed(11)).tolist()
    pages = list(range(1, 12))

    def run(m, kv: KVCache, start: int, n: int) -> torch.Tensor:
        ctx = ForwardContext.build([Segment(pages, start, n)], PAGE)
        return m.logits(m.forward(m.embed(torch.tensor(ids[start : start + n])), ctx, kv))

    kvs = {m: KVCache(model.config, 12, PAGE, ACTIVATION_DTYPE["int4"]) for m in (eager, model)}
    for m, kv in kvs.items():
        run(m, kv, 0, 30)  # the prompt
    window = run(model, kvs[model], 30, 5)
    alone = torch.cat([run(model, kvs[model], 30 + i, 1) for i in range(5)])
    assert torch.equal(window, alone)
    reference = torch.cat([run(eager, kvs[eager], 30 + i, 1) for i in range(5)])
    assert torch.allclose(alone, reference, atol=0.05, rtol=0.02)
    assert torch.equal(alone.argmax(-1), reference.argmax(-1))
