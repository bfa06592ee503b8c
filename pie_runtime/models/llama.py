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

# A batch-invariant model attends in slices of at most this many query rows per sequence (any verify window is
# one slice), so that a row's bits do not depend on how its prompt was chunked: a prefix-cache hit recomputes a
# prompt's tail in a short window that a first run computed inside a long chunk. Slicing costs about 11% of an
# int4 prefill against one SDPA call per chunk (768 rows in 3 chunks: 783 vs 694 ms, 2 threads).
INVARIANT_MAX_ROWS = 64


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:  # torch's kernel accumulates a bf16 input in float32 by itself
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj: nn.Module = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5
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
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]  # (slots, kvh, D)
        k_cache.index_copy_(0, ctx.write_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, ctx.write_slots, v.to(v_cache.dtype))
        ps = kv.page_size
        k_pages = k_cache.view(-1, ps, kvh, d)  # (pages, ps, kvh, D)
        v_pages = v_cache.view(-1, ps, kvh, d)

        out = torch.empty(n, h, d, dtype=q.dtype, device=q.device)
        for g in ctx.groups:
            b, p = g.key_pages.shape
            # whole pages are gathered (contiguous blocks), far cheaper than gathering slot by slot
            kg = k_pages.index_select(0, g.key_pages.flatten()).view(b, p * ps, kvh, d).transpose(1, 2)
            vg = v_pages.index_select(0, g.key_pages.flatten()).view(b, p * ps, kvh, d).transpose(1, 2)
            qg = q[g.query_rows].transpose(1, 2)  # (B, h, Q, D)
            if self.batch_invariant:
                # longer chunks too, in slices of windows' size: a prompt's rows then get the same bits however
                # it was chunked or how much of it a prefix-cache hit skipped
                kq, vq = kg.to(q.dtype), vg.to(q.dtype)
                step = INVARIANT_MAX_ROWS
                og = torch.cat(
                    [
                        attend_invariant(qg[:, :, i : i + step], kq, vq, g.mask[:, :, i : i + step], self.scale)
                        for i in range(0, qg.shape[2], step)
                    ],
                    dim=2,
                )
            else:
                og = F.scaled_dot_product_attention(
                    qg, kg.to(q.dtype), vg.to(q.dtype), attn_mask=g.mask, scale=self.scale, enable_gqa=True
                )
            out[g.valid_rows] = og.transpose(1, 2)[g.query_valid]  # (B, Q, h, D) → valid rows
        return out.view(n, h * d)

    def forward(self, x, cos, sin, ctx: ForwardContext, kv: KVCache) -> torch.Tensor:
        return self.o_proj(self.attend(*self.project(x, cos, sin), ctx, kv))


def attend_invariant(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention whose result for a query row does not depend on the other rows of the call nor on how many
    masked keys pad its sequence: q (B, h, Q, D), k/v (B, kvh, K, D), mask (B, 1, Q, K) → (B, h, Q, D).

    A verify window of 1 + k rows must give each row the bits a 1-row decode pass gives it, or greedy
    speculation could part from plain decoding on a near tie. In bfloat16, SDPA's result moves with the
    padded key length; oneDNN's bf16 matmuls do not (each output accumulates its own dot product in float32
    in a fixed order, and padded keys add exact zeros). So the scores, and the weighted sum of V together
    with its normaliser (a column of ones beside V), are matmuls; max and exp are exact elementwise ops.
    Query heads that share a key head are stacked as extra query rows of that head (grouped-query attention)."""
    b, h, nq, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qs = q.reshape(b, kvh, g * nq, d)  # head i uses key head i // g: heads of a group are adjacent
    # keys made contiguous, then viewed transposed: the batched matmul then folds (B, kvh) into one batch of
    # plain transposed matrices whatever B is. On the gathered strided view it copied them into another
    # layout when B > 1 and not when B = 1, and on CPUs without bf16 units (AVX2) the two paths round
    # differently, so a row's scores changed with the batch it was in (and the copy cost 4x the matmul)
    kt = k.contiguous().transpose(-1, -2)
    scores = torch.matmul(qs, kt).float() * scale  # (B, kvh, g*Q, K)
    scores = scores.masked_fill(~mask.repeat(1, 1, g, 1), float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True)).to(q.dtype)
    ones = torch.ones(*v.shape[:-1], 1, dtype=v.dtype, device=v.device)
    summed = torch.matmul(weights, torch.cat([v, ones], dim=-1)).float()  # (B, kvh, g*Q, D + 1)
    out = summed[..., :d] / summed[..., d:]
    return out.to(q.dtype).reshape(b, h, nq, d)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj: nn.Module = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one matmul, once prepared for serving

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: ForwardContext, kv: KVCache) -> torch.Tensor:
        attn = self.self_attn
        a = attn.attend(*attn.project(self.input_layernorm(x), cos, sin), ctx, kv)
        x = x + attn.o_proj(a)
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
    def forward(self, hidden: torch.Tensor, ctx: ForwardContext, kv: KVCache, state: object = None) -> torch.Tensor:
        """hidden: (N, H) input embeddings → (N, H) final hidden states after the last norm. ``state``: the
        recurrent-state pool, which this family does not use (the engine passes every family the same)."""
        cos, sin = self.rotary.cos_sin(ctx.positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, ctx, kv)
        return self.model.norm(hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) final hidden states → (R, V) float32 logits."""
        return self.lm_head(hidden).float()
