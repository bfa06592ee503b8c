"""Mamba (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces"): a stack of
residual blocks, each an RMS norm and a mixer, over a ragged batch whose sequences carry recurrent state.

The mixer (the paper's Figure 3 and Algorithm 2), for input x of one row:

    x, z  = in_proj(x)                           expand to D = expand * hidden, and a gate
    x     = silu(causal_conv1d(x))               depthwise, kernel K, continuing the sequence's last K-1 inputs
    Δ,B,C = x_proj(x)                            selective: Δ (rank R), B and C (S each) depend on the input
    Δ     = softplus(dt_proj(Δ))                 back to D channels
    h     = exp(Δ A) h + Δ B x;  y = C h + D x   the scan, A = -exp(A_log) (D, S)
    out   = out_proj(y * silu(z))

A sequence's state is the conv's last K-1 inputs and h, per layer (``state_shapes``), in the state pool
(``state_cache.py``); the :class:`ForwardContext` names each segment's entry. There is no attention, so the
KV cache argument is unused. Parameter names equal Hugging Face's ``MambaForCausalLM``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MambaConfig
from .context import ForwardContext
from .kv_cache import KVCache
from .linear import Linear
from .llama import RMSNorm
from .recurrent import causal_conv, selective_scan
from .state_cache import StateCache, StateShapes


class MambaMixer(nn.Module):
    def __init__(self, cfg: MambaConfig, layer: int):
        super().__init__()
        self.layer = layer
        d, s, r = cfg.intermediate_size, cfg.state_size, cfg.time_step_rank
        self.rank, self.state_size = r, s
        self.in_proj = Linear(cfg.hidden_size, 2 * d, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(d, d, cfg.conv_kernel, groups=d, bias=cfg.use_conv_bias, padding=cfg.conv_kernel - 1)
        self.x_proj = Linear(d, r + 2 * s, bias=False)
        self.dt_proj = Linear(r, d, bias=True)
        self.A_log = nn.Parameter(torch.zeros(d, s))
        self.D = nn.Parameter(torch.ones(d))
        self.out_proj = Linear(d, cfg.hidden_size, bias=cfg.use_bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: StateCache) -> torch.Tensor:
        """x (N, H) normed → (N, H); advances each segment's conv and scan state."""
        lay = ctx.states
        assert lay is not None, "a Mamba forward needs each segment's state entry"
        conv_state, ssm_state = state.layers[self.layer]
        u, z = self.in_proj(x).chunk(2, dim=-1)  # (N, D) each
        u = F.silu(causal_conv(u, conv_state, self.conv1d.weight, self.conv1d.bias, lay))
        dt, bm, cm = torch.split(self.x_proj(u), [self.rank, self.state_size, self.state_size], dim=-1)
        dt = F.softplus(F.linear(dt, self.dt_proj.weight).float() + self.dt_proj.bias.float())
        a = -torch.exp(self.A_log.float())
        y = selective_scan(u, dt, a, bm, cm, ssm_state, lay)
        y = (y + u.float() * self.D.float()) * F.silu(z.float())
        return self.out_proj(y.to(x.dtype))


class MambaBlock(nn.Module):
    def __init__(self, cfg: MambaConfig, layer: int):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = MambaMixer(cfg, layer)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: StateCache) -> torch.Tensor:
        return x + self.mixer(self.norm(x), ctx, state)


class MambaBackbone(nn.Module):
    def __init__(self, cfg: MambaConfig):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class MambaForCausalLM(nn.Module):
    """``embed`` → ``forward`` (final hidden states, normed) → ``logits`` on the rows read out."""

    def __init__(self, cfg: MambaConfig):
        super().__init__()
        self.config = cfg
        self.backbone = MambaBackbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @staticmethod
    def state_shapes(cfg: MambaConfig) -> StateShapes:
        """Per layer: the conv's last K-1 inputs (D, K-1) and the scan's h (D, S)."""
        d = cfg.intermediate_size
        return {i: ((d, cfg.conv_kernel - 1), (d, cfg.state_size)) for i in range(cfg.num_hidden_layers)}

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(token_ids)

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, ctx: ForwardContext, kv: KVCache | None, state: StateCache) -> torch.Tensor:
        """hidden: (N, H) input embeddings → (N, H) final hidden states after the last norm."""
        for layer in self.backbone.layers:
            hidden = layer(hidden, ctx, state)
        return self.backbone.norm_f(hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) final hidden states → (R, V) float32 logits."""
        return self.lm_head(hidden).float()
