"""An EAGLE-style drafter: one decoder layer over the target's own features, trained afterwards on a frozen
target by self-distillation.

Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (autoregression at the
feature level, the sampled token fed back in); Li et al. 2024, "EAGLE-2: Faster Inference of Language Models
with Dynamic Draft Trees"; Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test" (training on the drafter's own chained outputs). Served here as a chain
(one draft per step, no tree) over the last layer's feature only (no EAGLE-3 multi-layer fusion).

The feature ``u_p`` of position p is the target's last-layer residual stream at p, RMS-normalized without
the final norm's weight: ``u_p = x_p / rms(x_p)``, so that ``target.norm(x_p) = w * u_p``. The final norm
is scale-invariant, so ``u`` loses nothing the lm head reads, gives the draft layer an input of fixed scale,
and is recovered exactly from the normed hidden states the teacher pass keeps (``u = h / w``). One step::

    x_p   = fc([u_{p-1} ; rms(embed(t_p))])                       (2H → H)
    x_p   = layer(x_p)                                           one Llama decoder layer, causal attention
    û_p   = x_p / rms(x_p)                                       the predicted feature of position p
    logits(t_{p+1}) = target.lm_head(target.norm(x_p))           the target's own norm and head (shared)

Chained for k drafts from row n: step j runs at position n+j on (û_{n+j-1}, d_{j-1}) with û_n = u_n (the
target's) and d_0 the target's token after n. Its attention reads the draft layer's K/V of positions
0..n and those of the steps before it. Serving keeps the former in the target's KV pool as one extra layer
(index ``kv_layer`` = the target's layer count): every fire computes the draft layer's K/V for its rows, so
fork, trim, truncate and the prefix cache carry them like any layer's; the chained steps' K/V are held
densely and never written to pages.

The file format: ``<stem>.safetensors`` (the module's tensors) and ``<stem>.json`` (:class:`EagleConfig`),
which names its target by the sha256 of the target's weights file as recorded in the target's manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from .config import ModelConfig
from .context import ForwardContext
from .draft_vocab import draft_logits
from .head_files import load_head, read_head_config, save_head
from .kv_cache import KVCache
from .linear import Linear
from .llama import DecoderLayer, LlamaForCausalLM, RMSNorm


class EagleConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["pie-eagle"] = "pie-eagle"
    version: Literal[1] = 1
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    rms_norm_eps: float = 1e-5
    kv_layer: int = Field(ge=0)  # the KV pool layer its K/V live in: the target's number of layers
    depth: int = Field(ge=1, le=16)  # the largest k served (training chained this many steps)
    target: str  # the target's name when trained (informational)
    target_digest: str  # sha256 of the target's weights file, from its manifest: the binding check
    draft_vocab: int = Field(
        default=0, ge=0
    )  # drafts from this many tokens' lm head rows (models/draft_vocab.py); 0: all
    training: dict = Field(default_factory=dict)  # command, corpus, tokens, held-out acceptance

    @classmethod
    def for_target(cls, cfg: ModelConfig, depth: int, target: str, digest: str, intermediate: int | None = None):
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=intermediate or cfg.intermediate_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=cfg.rms_norm_eps,
            kv_layer=cfg.num_hidden_layers,
            depth=depth,
            target=target,
            target_digest=digest,
        )

    def layer_config(self) -> ModelConfig:
        """The draft layer's geometry as a model config (only what a DecoderLayer reads is meaningful)."""
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=1,
            rms_norm_eps=self.rms_norm_eps,
        )


def unit_rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / rms(x) over the last dimension, computed in float32: the feature of a residual stream."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class EagleModule(nn.Module):
    """The trainable part: ``fc`` and one decoder layer. The target's embedding, norm and head are not in it."""

    draft_ids: torch.Tensor  # a buffer only with a reduced draft vocabulary (models/draft_vocab.py)

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.config = cfg
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg.layer_config(), cfg.kv_layer)
        if cfg.draft_vocab:
            self.register_buffer("draft_ids", torch.zeros(cfg.draft_vocab, dtype=torch.int64))

    def inputs(self, features: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """(..., H) features of the positions before and (..., H) embeddings of the tokens → (..., H) x."""
        return self.fc(torch.cat([features.to(emb.dtype), self.enorm(emb)], dim=-1))


class EagleHead:
    """An EAGLE module bound to its target: ``write_kv`` fills its pool layer for a fire's rows, ``draft``
    chains k drafts from some rows."""

    def __init__(self, module: EagleModule, target: LlamaForCausalLM):
        self.module = module
        self.target = target
        self.depth = module.config.depth
        self.norm_weight = target.model.norm.weight
        self.logits = draft_logits(module, target)

    def feature(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, H) normed final hidden states → (N, H) features u = h / w (module docstring)."""
        return hidden / self.norm_weight.to(hidden.dtype)

    @torch.inference_mode()
    def write_kv(self, prev: torch.Tensor, tokens: torch.Tensor, ctx: ForwardContext, kv: KVCache) -> None:
        """Writes the draft layer's K/V of a forward's rows into its pool layer. prev: (N, H) the feature of
        the position before each row; tokens: (N,) the row's token. Only K and V are needed (the layer's
        output at these rows would predict features the target has just computed), so no attention runs."""
        m = self.module
        x = m.inputs(prev, self.target.embed(tokens))
        cos, sin = self.target.rotary.cos_sin(ctx.positions, x.dtype)
        _, k, v = m.layer.self_attn.project(m.layer.input_layernorm(x), cos, sin)
        layer = m.config.kv_layer
        kv.k[layer].index_copy_(1, ctx.write_slots, k.transpose(0, 1).to(kv.k.dtype))  # (kvh, slots, D)
        kv.v[layer].index_copy_(1, ctx.write_slots, v.transpose(0, 1).to(kv.v.dtype))

    @torch.inference_mode()
    def draft(
        self,
        feature: torch.Tensor,
        first: torch.Tensor,
        index: torch.Tensor,
        page_table: list[int],
        kv: KVCache,
        k: int,
        with_logits: bool = True,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Greedy chains of k drafts from R rows of one sequence. feature: (R, H) u_n of each row; first:
        (R,) the target's token after it; index: (R,) int64 sequence index n of each row (its chain reads
        the pool layer's K/V of 0..n). Returns (R, k) draft tokens and the k (R, V) float32 logits (none
        without ``with_logits``: a greedy readout needs only the tokens, which come out the same)."""
        m, layer = self.module, self.module.layer
        attn = layer.self_attn
        r = feature.shape[0]
        ps, n_keys = kv.page_size, int(index.max()) + 1
        slots = torch.tensor(
            [page_table[i // ps] * ps + i % ps for i in range(n_keys)], dtype=torch.int64, device=feature.device
        )
        dtype = feature.dtype
        pk = kv.k[m.config.kv_layer].index_select(1, slots).to(dtype)  # (kvh, K, D)
        pv = kv.v[m.config.kv_layer].index_select(1, slots).to(dtype)
        pk, pv = pk.unsqueeze(0).expand(r, -1, -1, -1), pv.unsqueeze(0).expand(r, -1, -1, -1)  # (R, kvh, K, D)
        seen = torch.arange(n_keys, device=feature.device).unsqueeze(0) <= index.unsqueeze(1)  # (R, K)
        ck: list[torch.Tensor] = []
        cv: list[torch.Tensor] = []
        u, tok = feature, first
        tokens, logits = [], []
        for j in range(1, k + 1):
            x = m.inputs(u, self.target.embed(tok))
            cos, sin = self.target.rotary.cos_sin(index + j, dtype)
            q, kj, vj = attn.project(layer.input_layernorm(x), cos, sin)  # (R, h, D), (R, kvh, D)
            ck.append(kj.unsqueeze(2))
            cv.append(vj.unsqueeze(2))
            keys = torch.cat([pk, *ck], dim=2)  # (R, kvh, K + j, D)
            vals = torch.cat([pv, *cv], dim=2)
            mask = torch.cat([seen, seen.new_ones(r, j)], dim=1).view(r, 1, 1, -1)
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, vals, attn_mask=mask, scale=attn.scale, enable_gqa=True
            )  # (R, h, 1, D)
            x = x + attn.o_proj(o.reshape(r, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            tok, lg = self.logits.draft(self.target.model.norm(x), with_logits)
            u = unit_rms(x)
            tokens.append(tok)
            if lg is not None:
                logits.append(lg)
        return torch.stack(tokens, dim=1), logits


def read_config(weights: Path) -> EagleConfig:
    return read_head_config(EagleConfig, weights)


def save_eagle(module: EagleModule, weights: Path) -> None:
    """Writes the tensors in bfloat16 (a draft's quality does not need more) and the config beside them."""
    save_head(module, module.config, weights, torch.bfloat16, "eagle")


def load_eagle(weights: Path, dtype: torch.dtype = torch.float32, device="cpu") -> EagleModule:
    """Reads the config and tensors; a missing, unexpected or misshapen tensor raises ValueError."""
    return load_head(EagleModule, read_config(weights), weights, "EAGLE", dtype, device)
