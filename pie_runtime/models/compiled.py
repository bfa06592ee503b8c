"""``torch.compile`` of the whole decoder as one graph, the engine's ``--compile``.

At a few rows a step is mostly small ops: the norms, rope, residual adds, casts and the MLP's gate cost more
than the int4 matmuls. Inductor fuses them into a few C++ kernels a layer. Paged attention runs inside the
graph as an opaque custom op (``pie::paged_attention``): it writes the KV pool and loops over the pass's
attention groups, which change every step and would make the compiler specialize endlessly, and as an op of
its own it costs no graph break (one a layer cost more than the fusion saved when each layer was compiled
around an eager attention; docs/performance.md, "--compile"). The op finds the
pass's context and KV pool in :data:`_PASSES`, set by the model's forward just before the graph runs.

Exactness: a verify window's row must get the bits a 1-row pass gives it. Inductor keeps float32 inside a
fused kernel and rounds to bf16 where a kernel ends, and it fuses a 1-row graph (dynamo specializes size 1)
otherwise than a wider one, so rows differed; ``emulate_precision_casts`` rounds where eager rounds, which makes
them equal again, and ``split_reductions`` is off so that a row's reduction is never split across kernels.

A compiled pass is a few percent faster than eager at 1 to 4 rows, but compiling takes a minute or more cold on
a small CPU (the engine does it before it says ready, and reports the time), less with inductor's on-disk cache
warm, so it is off by default (docs/performance.md, "--compile").
"""

from __future__ import annotations

import itertools
from typing import cast

import torch
import torch._inductor.config as inductor_config

from .context import ForwardContext
from .kv_cache import KVCache
from .llama import DecoderLayer, LlamaForCausalLM

# model key → (the model's layers, the running pass's context and KV pool)
_PASSES: dict[int, tuple[list[DecoderLayer], ForwardContext | None, KVCache | None]] = {}
_KEYS = itertools.count()


@torch.library.custom_op("pie::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: int, layer: int) -> torch.Tensor:
    """One layer's :meth:`Attention.attend` for the pass the model ``model`` is running → (N, h * D)."""
    layers, ctx, kv = _PASSES[model]
    assert ctx is not None and kv is not None, "paged_attention runs only inside a compiled forward"
    return layers[layer].self_attn.attend(q, k, v, ctx, kv)  # a new tensor: no input aliased


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: int, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def compile_decoder(model: LlamaForCausalLM) -> None:
    """Replaces the model's forward, in place, by one compiled graph over all its layers."""
    inductor_config.split_reductions = False
    inductor_config.emulate_precision_casts = True
    key = next(_KEYS)
    decoder_layers = cast(list[DecoderLayer], list(model.model.layers))
    _PASSES[key] = (decoder_layers, None, None)

    def layers(hidden: torch.Tensor, tables: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # DecoderLayer.forward, with the attention through the op (a change there belongs here too)
        for i, layer in enumerate(decoder_layers):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(hidden), *tables[layer.rope_kind])
            hidden = layer.finish(hidden, paged_attention(q, k, v, key, i))
        return model.model.norm(hidden)

    graph = torch.compile(layers, dynamic=True)

    @torch.inference_mode()
    def forward(hidden: torch.Tensor, ctx: ForwardContext, kv: KVCache, state: object = None) -> torch.Tensor:
        tables = {kind: r.cos_sin(ctx.positions, hidden.dtype) for kind, r in model.rotaries.items()}
        _PASSES[key] = (decoder_layers, ctx, kv)
        try:
            return graph(hidden, tables)
        finally:
            _PASSES[key] = (decoder_layers, None, None)

    model.forward = forward  # type: ignore[method-assign]
