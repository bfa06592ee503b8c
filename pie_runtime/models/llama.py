"""The Llama-family decoder (Touvron et al. 2023) with config switches for SmolLM2, Mistral (sliding window),
Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMS norm) and Gemma 3 (the recipe fields of :class:`ModelConfig`:
GeGLU, norms of 1 + w, sandwich norms, scaled embeddings, a rope table and window per layer kind), over a
paged KV cache.

One forward runs a ragged batch: N rows from many sequences, each row with its own position, K/V written
to and read from the shared page pool through the :class:`ForwardContext`. Parameter names equal Hugging
Face's, so a checkpoint's state dict loads as it is.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .attention_math import (
    Fp32KeyBlocks,
    attend_fp32_blocks,
    attend_invariant,
    attention_bias,
    fp32_attention_bias,
)
from .config import ModelConfig
from .context import AttentionGroup, ForwardContext
from .cpu import bf16_is_fast
from .kv_cache import KVCache
from .linear import Linear
from .rope import Rotary, apply_rotary

# None: the float32 form on CPUs without bf16 units, else bf16's; tests set it to run either form anywhere
FP32_ATTENTION: bool | None = None


class RMSNorm(nn.Module):
    """rms_normed(x) * (offset + weight): offset 0 for Llama, 1 for Gemma (whose norms compute in float32)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            w = self.weight.float() + self.offset
            return F.rms_norm(x.float(), (x.shape[-1],), w, self.eps).to(x.dtype)
        if x.dtype == self.weight.dtype:  # torch's kernel accumulates a bf16 input in float32 by itself
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    window: int | None = None  # keys a query sees (None: every earlier one); subclasses without windows keep it

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj: nn.Module = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_weight_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_weight_offset)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.attention_scale
        self.window = cfg.attention_window(layer)  # keys this layer's queries see (None: every earlier one)
        self.qkv_proj: nn.Module | None = None  # q, k and v in one matmul, once prepared for serving
        self.batch_invariant = False  # attend windows with batch-invariant matmuls (attend_invariant)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N, H) normed input → q (N, h, D), k and v (N, kvh, D), q and k rotated."""
        n, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(n, h + 2 * kvh, d)
            if not self.qk_norm:  # one rotation over q's and k's heads together
                qk = apply_rotary(qkv[:, : h + kvh], cos, sin)
                return qk[:, :h], qk[:, h:], qkv[:, h + kvh :]
            q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
        else:
            q = self.q_proj(x).view(n, h, d)
            k = self.k_proj(x).view(n, kvh, d)
            v = self.v_proj(x).view(n, kvh, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, kv: KVCache
    ) -> torch.Tensor:
        """Writes k and v into the cache, attends each row over its sequence's pages → (N, h * D)."""
        n, h, kvh, d = q.shape[0], self.heads, self.kv_heads, self.head_dim
        k_cache, v_cache = kv.layer(self.layer)  # (kvh, slots, D) of its page group's pages
        view = ctx.view(self.layer)  # its page group's slots and its window's attention calls
        k_cache.index_copy_(1, view.write_slots, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, view.write_slots, v.transpose(0, 1).to(v_cache.dtype))
        if ctx.scores is not None:  # the attention readout, only on a pass that reads it
            ctx.scores.add(self.layer, q, k_cache, self.scale)
        ps = kv.page_size
        k_pages = k_cache.view(kvh, -1, ps, d)  # (kvh, pages, ps, D)
        v_pages = v_cache.view(kvh, -1, ps, d)
        fp32 = self.batch_invariant and _fp32_attention(q)
        window = self.window

        out = None if _one_span(view.groups, n) else torch.empty(n, h, d, dtype=q.dtype, device=q.device)
        for g in view.groups:
            b, p = g.key_pages.shape
            if g.row_span is not None:  # the rows in order: a slice, laid out as the gather would lay it out
                first, count = g.row_span
                qg = q[first : first + count].reshape(b, count // b, h, d).transpose(1, 2)  # (B, h, Q, D)
            else:
                qg = q[g.query_rows].transpose(1, 2)
            mask = g.layer_mask(window)
            if fp32:
                og = self._attend_fp32(qg, k_pages, v_pages, g)
            else:
                # whole pages are gathered (contiguous blocks), far cheaper than gathering slot by slot
                pages = g.key_pages.flatten()
                kg = k_pages.index_select(1, pages).view(kvh, b, p * ps, d).transpose(0, 1).to(q.dtype)
                vg = v_pages.index_select(1, pages).view(kvh, b, p * ps, d).transpose(0, 1).to(q.dtype)
                if self.batch_invariant:
                    og = self._attend_bf16(qg, kg, vg, g)
                else:
                    og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=self.scale, enable_gqa=True)
            if out is None:
                return og.transpose(1, 2).reshape(n, h * d)
            if g.row_span is not None:
                first, count = g.row_span
                out[first : first + count] = og.transpose(1, 2).reshape(count, h, d)
            else:
                out[g.valid_rows] = og.transpose(1, 2)[g.query_valid]  # (B, Q, h, D) → valid rows
        assert out is not None
        return out.view(n, h * d)

    def _attend_bf16(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """The batch-invariant bf16 form, with the group's additive mask made by the pass's first layer and kept
        for the others."""
        mask = g.layer_mask(self.window)
        bias = g.memo.get(("bf16", self.window))
        if bias is None:
            bias = g.memo[("bf16", self.window)] = attention_bias(mask)
        return attend_invariant(q, k, v, mask, self.scale, bias)  # type: ignore[arg-type]

    def _attend_fp32(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, g: AttentionGroup
    ) -> torch.Tensor:
        """The float32 form over the group's pages gathered into its padded key blocks, with the mask and the
        blocks' buffers made by the pass's first layer and kept for the others."""
        per_kv = self.heads // self.kv_heads
        memo = g.memo.get(("fp32", per_kv, self.window))
        if memo is None:
            memo = g.memo[("fp32", per_kv, self.window)] = (
                fp32_attention_bias(g.layer_mask(self.window), per_kv),
                Fp32KeyBlocks(g.key_pages, k_pages),
            )
        bias, blocks = cast(tuple[list[torch.Tensor], Fp32KeyBlocks], memo)
        kb, vb = blocks.gather(k_pages, v_pages)
        return attend_fp32_blocks(q, kb, vb, bias, self.scale)

    def forward(self, x, cos, sin, ctx: ForwardContext, kv: KVCache) -> torch.Tensor:
        return self.o_proj(self.attend(*self.project(x, cos, sin), ctx, kv))


def _one_span(groups: tuple[AttentionGroup, ...], n: int) -> bool:
    """True when the pass is one attention group whose queries are all ``n`` rows in order (a decode step,
    one verify window): its output is the layer's, with no scatter."""
    return len(groups) == 1 and groups[0].row_span == (0, n)


def _fp32_attention(q: torch.Tensor) -> bool:
    if FP32_ATTENTION is not None:
        return FP32_ATTENTION
    return q.device.type == "cpu" and not bf16_is_fast()


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_activation]
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj: nn.Module = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one matmul, once prepared for serving

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        h, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset
        self.input_layernorm = RMSNorm(h, eps, off)
        self.post_attention_layernorm = RMSNorm(h, eps, off)
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, off)
            self.post_feedforward_layernorm = RMSNorm(h, eps, off)
        self.rope_kind = cfg.rope_kind(layer)  # which of the model's rope tables this layer rotates by

    def forward(self, x, cos, sin, ctx: ForwardContext, kv: KVCache) -> torch.Tensor:
        attn = self.self_attn
        return self.finish(x, attn.attend(*attn.project(self.input_layernorm(x), cos, sin), ctx, kv))

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer after its attention: ``x`` the layer's input, ``attended`` (N, h * D) before o_proj."""
        a = self.self_attn.o_proj(attended)
        if self.sandwich:  # Gemma: the norms wrap each block's output too, post_attention_layernorm among them
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)


class LlamaForCausalLM(nn.Module):
    """``embed`` → ``forward`` (final hidden states, normed) → ``logits`` on the rows read out."""

    attention_scores = True  # a pass can read the attention mass out (ForwardContext.scores)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg)  # the full-attention layers' table (what drafters and compiled passes use)
        self.rotaries = {cfg.rope_kind(i): Rotary(cfg, *cfg.layer_rope(i)) for i in range(cfg.num_hidden_layers)}
        self.embed_scale = cfg.embed_scale

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        e = self.model.embed_tokens(token_ids)
        if self.embed_scale != 1.0:  # Gemma: sqrt(hidden), rounded to the table's dtype first as transformers does
            e = e * torch.tensor(self.embed_scale, dtype=e.dtype)
        return e

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, ctx: ForwardContext, kv: KVCache, state: object = None) -> torch.Tensor:
        """hidden: (N, H) input embeddings → (N, H) final hidden states after the last norm. ``state``: the
        recurrent-state pool, which this family does not use (the engine passes every family the same)."""
        tables = {kind: r.cos_sin(ctx.positions, hidden.dtype) for kind, r in self.rotaries.items()}
        for layer in cast(list[DecoderLayer], list(self.model.layers)):
            hidden = layer(hidden, *tables[layer.rope_kind], ctx, kv)
        return self.model.norm(hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) final hidden states → (R, V) float32 logits."""
        return self.lm_head(hidden).float()
