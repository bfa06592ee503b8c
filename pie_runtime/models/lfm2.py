"""LFM2 (Liquid AI's hybrid): a stack of layers that are either a gated short convolution or grouped-query
attention, each followed by a SwiGLU MLP, over a ragged batch.

    conv layer:       B, C, x = in_proj(x);  y = out_proj(C * causal_conv1d(B * x))   kernel L (``conv_L_cache``)
    attention layer:  Llama's paged attention (models/llama.py) with q/k RMS norm, names as Hugging Face's

A sequence's state is, per conv layer, its last L-1 inputs ``B * x`` (the state pool, ``state_cache.py``);
its attention layers keep their K/V in the paged cache exactly as the Llama family does (the KV cache is
indexed by attention layer only). Parameter names equal Hugging Face's ``Lfm2ForCausalLM``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import Lfm2Config
from .context import ForwardContext
from .kv_cache import KVCache
from .linear import Linear
from .llama import Attention, RMSNorm
from .recurrent import causal_conv
from .rope import Rotary, apply_rotary
from .state_cache import StateCache, StateShapes


class Lfm2Attention(Attention):
    """Llama's paged attention (its ``attend``) under LFM2's parameter names: ``out_proj``, ``q_layernorm``,
    ``k_layernorm`` (a per-head RMS norm on q and k before RoPE)."""

    def __init__(self, cfg: Lfm2Config, kv_layer: int):
        nn.Module.__init__(self)
        self.layer = kv_layer  # index among the attention layers: the KV cache holds only those
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.q_size, bias=False)
        self.k_proj = Linear(cfg.hidden_size, cfg.kv_size, bias=False)
        self.v_proj = Linear(cfg.hidden_size, cfg.kv_size, bias=False)
        self.out_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_layernorm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_layernorm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = None
        self.batch_invariant = False

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        q = self.q_layernorm(self.q_proj(x).view(n, self.heads, self.head_dim))
        k = self.k_layernorm(self.k_proj(x).view(n, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, ctx: ForwardContext, kv: KVCache) -> torch.Tensor:
        return self.out_proj(self.attend(*self.project(x, cos, sin), ctx, kv))


class Lfm2ShortConv(nn.Module):
    def __init__(self, cfg: Lfm2Config, layer: int):
        super().__init__()
        h, k = cfg.hidden_size, cfg.conv_L_cache
        self.layer = layer
        self.conv = nn.Conv1d(h, h, k, groups=h, bias=cfg.conv_bias, padding=k - 1)
        self.in_proj = Linear(h, 3 * h, bias=cfg.conv_bias)
        self.out_proj = Linear(h, h, bias=cfg.conv_bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: StateCache) -> torch.Tensor:
        lay = ctx.states
        assert lay is not None, "an LFM2 forward needs each segment's state entry"
        b, c, u = self.in_proj(x).chunk(3, dim=-1)  # (N, H) each
        y = causal_conv(b * u, state.layers[self.layer][0], self.conv.weight, self.conv.bias, lay)
        return self.out_proj(c * y)


class Lfm2MLP(nn.Module):
    def __init__(self, cfg: Lfm2Config):
        super().__init__()
        self.w1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w3 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, cfg: Lfm2Config, layer: int, kv_layer: int | None):
        super().__init__()
        if kv_layer is not None:
            self.self_attn = Lfm2Attention(cfg, kv_layer)
        else:
            self.conv = Lfm2ShortConv(cfg, layer)
        self.is_attention = kv_layer is not None
        self.feed_forward = Lfm2MLP(cfg)
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x, cos, sin, ctx: ForwardContext, kv: KVCache, state: StateCache) -> torch.Tensor:
        h = self.operator_norm(x)
        x = x + (self.self_attn(h, cos, sin, ctx, kv) if self.is_attention else self.conv(h, ctx, state))
        return x + self.feed_forward(self.ffn_norm(x))


class Lfm2Model(nn.Module):
    def __init__(self, cfg: Lfm2Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        kv_index = [sum(t == "full_attention" for t in cfg.layer_types[:i]) for i in range(cfg.num_hidden_layers)]
        self.layers = nn.ModuleList(
            Lfm2DecoderLayer(cfg, i, kv_index[i] if t == "full_attention" else None)
            for i, t in enumerate(cfg.layer_types)
        )
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)  # Hugging Face's name for the final norm


class Lfm2ForCausalLM(nn.Module):
    """``embed`` → ``forward`` (final hidden states, normed) → ``logits`` on the rows read out."""

    def __init__(self, cfg: Lfm2Config):
        super().__init__()
        self.config = cfg
        self.model = Lfm2Model(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg)

    @staticmethod
    def state_shapes(cfg: Lfm2Config) -> StateShapes:
        """Per conv layer: its last L-1 inputs (H, L-1)."""
        return {i: ((cfg.hidden_size, cfg.conv_L_cache - 1),) for i, t in enumerate(cfg.layer_types) if t == "conv"}

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, ctx: ForwardContext, kv: KVCache, state: StateCache) -> torch.Tensor:
        """hidden: (N, H) input embeddings → (N, H) final hidden states after the last norm."""
        cos, sin = self.rotary.cos_sin(ctx.positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, ctx, kv, state)
        return self.model.embedding_norm(hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) final hidden states → (R, V) float32 logits."""
        return self.lm_head(hidden).float()
