"""The dense forward of the engine's Llama-family model, for training and the teacher pass: (B, T) batches of
sequences that share one length, plain causal attention over contiguous K/V instead of the paged cache.

The weights are the serving model's own (:mod:`pie_runtime.models.llama`); only the attention's K/V layout
differs, and ``tests/drafters/test_dense_forward.py`` holds the two forwards equal. The paged forward is
for serving (ragged rows, shared pages); this one is differentiable (no inference mode) and, at batch 32
of one length, many times faster on a CPU than the paged path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from ..models.llama import DecoderLayer, LlamaForCausalLM
from ..models.rope import apply_rotary


@dataclass
class DenseCache:
    """One layer's K/V for a batch of sequences that share one length: (B, kv_heads, capacity, D) buffers
    written in place, of which the first ``n`` positions are filled (a decode step copies one position, not
    the whole cache: growing it with ``torch.cat`` was half of a generation's time)."""

    k: torch.Tensor
    v: torch.Tensor
    n: int = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes (B, kv_heads, T, D) after the filled positions; returns every filled position's K and V."""
        t = k.shape[2]
        self.k[:, :, self.n : self.n + t] = k
        self.v[:, :, self.n : self.n + t] = v
        self.n += t
        return self.k[:, :, : self.n], self.v[:, :, : self.n]


def dense_layer(
    layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: DenseCache | None = None
) -> torch.Tensor:
    """One decoder layer over (B, T) with plain causal attention; same weights as the paged path.
    ``cache``: the K/V of the positions before, extended in place; x then holds the T positions after them
    (T = 1 when the cache is not empty: one decode step)."""
    a = layer.self_attn
    b, t, _ = x.shape
    h = layer.input_layernorm(x).reshape(b * t, -1)
    q = a.q_proj(h).view(b * t, a.heads, a.head_dim)
    k = a.k_proj(h).view(b * t, a.kv_heads, a.head_dim)
    v = a.v_proj(h).view(b, t, a.kv_heads, a.head_dim)
    if a.qk_norm:
        q, k = a.q_norm(q), a.k_norm(k)
    cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)  # (B*T, D)
    q = apply_rotary(q, cos, sin).view(b, t, a.heads, a.head_dim).transpose(1, 2)  # (B, h, T, D)
    k = apply_rotary(k, cos, sin).view(b, t, a.kv_heads, a.head_dim).transpose(1, 2)
    v = v.transpose(1, 2)
    first = 0 if cache is None else cache.n  # the position of x's first row
    if cache is not None:
        k, v = cache.extend(k, v)
    mask = None
    if a.window is not None:  # a sliding layer: query p sees keys q with p - W < q <= p
        qpos = torch.arange(first, first + t).unsqueeze(1)
        kpos = torch.arange(k.shape[2]).unsqueeze(0)
        mask = (kpos <= qpos) & (kpos > qpos - a.window)
    causal = mask is None and first == 0  # else one new position attends to all
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=a.scale, enable_gqa=True)
    return layer.finish(x, o.transpose(1, 2).reshape(b, t, -1))


def decoder_layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    """The model's decoder layers, typed (an ``nn.ModuleList`` yields plain modules)."""
    return cast("list[DecoderLayer]", list(model.model.layers))


def dense_hidden(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """(B, T) token ids from position 0 → (B, T, H) final normed hidden states."""
    x = model.embed(ids)
    tables = rope_tables(model, torch.arange(ids.shape[1]), x.dtype)
    for layer in decoder_layers(model):
        x = dense_layer(layer, x, *tables[layer.rope_kind])
    return model.model.norm(x)


def rope_tables(model: LlamaForCausalLM, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin of each rope kind the model's layers use (Gemma 3: global and local), by kind."""
    return {kind: r.cos_sin(positions, dtype) for kind, r in model.rotaries.items()}


@torch.inference_mode()
def greedy_generate(model: LlamaForCausalLM, prompts: list[list[int]], n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched greedy continuation with a dense KV cache (the prompts share one length, so no paging: on
    a CPU this is many times faster than the paged serving path at batch 32). Returns (tokens (B, P+n_new)
    int64, hidden (B, P+n_new, H)): the hidden state of every token, the last generated one included."""
    ids = torch.tensor(prompts, dtype=torch.int64)
    p = ids.shape[1]
    x = model.embed(ids)
    tables = rope_tables(model, torch.arange(p + n_new), x.dtype)
    a = decoder_layers(model)[0].self_attn
    shape = (ids.shape[0], a.kv_heads, p + n_new, a.head_dim)
    caches = [DenseCache(x.new_empty(shape), x.new_empty(shape)) for _ in model.model.layers]

    def run(x, lo, hi):
        for layer, cache in zip(decoder_layers(model), caches):
            cos, sin = tables[layer.rope_kind]
            x = dense_layer(layer, x, cos[lo:hi], sin[lo:hi], cache)
        return model.model.norm(x)

    hid = [run(x, 0, p)]
    toks = [ids]
    for step in range(n_new):
        nxt = model.logits(hid[-1][:, -1]).argmax(dim=-1)  # (B,)
        toks.append(nxt.unsqueeze(1))
        hid.append(run(model.embed(nxt).unsqueeze(1), p + step, p + step + 1))
    return torch.cat(toks, dim=1), torch.cat(hid, dim=1)
