"""The Llama-family decoder (Touvron et al. 2023) with config switches for SmolLM2, Mistral, Qwen2 (q/k/v
bias) and Qwen3 (per-head q/k RMS norm), over a paged KV cache.

One forward runs a ragged batch: N rows from many sequences, each row with its own position, K/V written
to and read from the shared page pool through the :class:`ForwardContext`. Parameter names equal Hugging
Face's, so a checkpoint's state dict loads as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .context import ForwardContext
from .kv_cache import KVCache
from .linear import Linear
from .rope import Rotary, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, cos, sin, ctx: ForwardContext, kv: KVCache) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)  # (N, h, D)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)  # (N, kvh, D)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]  # (slots, kvh, D)
        k_cache.index_copy_(0, ctx.write_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, ctx.write_slots, v.to(v_cache.dtype))
        ps = kv.page_size
        k_pages = k_cache.view(-1, ps, self.kv_heads, self.head_dim)  # (pages, ps, kvh, D)
        v_pages = v_cache.view(-1, ps, self.kv_heads, self.head_dim)

        out = torch.empty(n, self.heads, self.head_dim, dtype=q.dtype, device=q.device)
        for g in ctx.groups:
            b, p = g.key_pages.shape
            # whole pages are gathered (contiguous blocks), far cheaper than gathering slot by slot
            kg = k_pages.index_select(0, g.key_pages.flatten()).view(b, p * ps, self.kv_heads, self.head_dim)
            vg = v_pages.index_select(0, g.key_pages.flatten()).view(b, p * ps, self.kv_heads, self.head_dim)
            qg = q[g.query_rows].transpose(1, 2)  # (B, h, Q, D)
            og = F.scaled_dot_product_attention(
                qg,
                kg.transpose(1, 2).to(q.dtype),
                vg.transpose(1, 2).to(q.dtype),
                attn_mask=g.mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[g.valid_rows] = og.transpose(1, 2)[g.query_valid]  # (B, Q, h, D) → valid rows
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: ForwardContext, kv: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``embed`` → ``forward`` (final hidden states, normed) → ``logits`` on the rows read out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, ctx: ForwardContext, kv: KVCache) -> torch.Tensor:
        """hidden: (N, H) input embeddings → (N, H) final hidden states after the last norm."""
        cos, sin = self.rotary.cos_sin(ctx.positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, ctx, kv)
        return self.model.norm(hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) final hidden states → (R, V) float32 logits."""
        return self.lm_head(hidden).float()
