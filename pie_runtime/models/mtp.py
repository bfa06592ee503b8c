"""A multi-token-prediction (MTP) module in the style of DeepSeek-V3 (DeepSeek-AI 2024, §2.2), trained
afterwards on a frozen target by self-distillation.

One step maps the target's final hidden state at position t and the embedding of token t+1 to a hidden
state standing for position t+1, whose logits (through the target's own final norm and lm head) predict
token t+2::

    x     = W [rms(h_t) ; rms(embed(tok_{t+1}))]         (2H → H)
    x     = x + mlp_i(rms_i(x))                         for each block (SwiGLU, no attention: stateless)
    h_t+1 = target.norm(x)                              logits = target.lm_head(h_t+1)

Depth K reuses **one module K times** (weights shared across steps): step j takes step j-1's output
``h`` and the embedding of the token step j-1 predicted (or, while training, the token it was given).
The module has no attention, so it needs no KV cache of its own and a readout row is served on its own.

The file format: ``<stem>.safetensors`` (the module's tensors) and ``<stem>.json`` (:class:`MTPConfig`),
which names its target by the sha256 of the target's weights file as recorded in the target's manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from .config import ModelConfig
from .draft_vocab import draft_logits
from .families import CausalLM, final_norm
from .head_files import load_head, read_head_config, save_head
from .linear import Linear
from .llama import MLP, RMSNorm


class MTPConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["pie-mtp"] = "pie-mtp"
    version: Literal[1] = 1
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_blocks: int = Field(default=2, ge=0)
    depth: int = Field(ge=1, le=16)  # the largest k the module was trained for (one module reused k times)
    shared: Literal[True] = True  # one module reused at every step (not k chained modules)
    vocab_size: int = Field(gt=0)
    rms_norm_eps: float = 1e-5
    target: str  # the target's name when trained (informational)
    target_digest: str  # sha256 of the target's weights file, from its manifest: the binding check
    draft_vocab: int = Field(
        default=0, ge=0
    )  # drafts from this many tokens' lm head rows (models/draft_vocab.py); 0: all
    training: dict = Field(default_factory=dict)  # command, corpus, tokens, epochs, held-out agreement


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class MTPModule(nn.Module):
    """The trainable part: (h, e) → pre-norm hidden. The target's norm, embedding and head are not in it."""

    draft_ids: torch.Tensor  # a buffer only with a reduced draft vocabulary (models/draft_vocab.py)

    def __init__(self, cfg: MTPConfig):
        super().__init__()
        mcfg = ModelConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=1,
            max_position_embeddings=1,
            rms_norm_eps=cfg.rms_norm_eps,
        )
        self.config = cfg
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.blocks = nn.ModuleList(_Block(mcfg) for _ in range(cfg.num_blocks))
        if cfg.draft_vocab:
            self.register_buffer("draft_ids", torch.zeros(cfg.draft_vocab, dtype=torch.int64))

    def forward(self, hidden: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """hidden, emb: (N, H) → (N, H) before the target's final norm."""
        x = self.proj(torch.cat([self.hnorm(hidden), self.enorm(emb)], dim=-1))
        for block in self.blocks:
            x = block(x)
        return x


class MTPHead:
    """An MTP module bound to its target: ``step`` chains one prediction, ``draft`` chains k."""

    def __init__(self, module: MTPModule, target: CausalLM):
        self.module = module
        self.target = target
        self.depth = module.config.depth
        self.norm = final_norm(target)
        self.logits = draft_logits(module, target)

    @torch.inference_mode()
    def step(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(R, H) normed hidden of the rows, (R,) the token after each → (R, H) normed hidden one further."""
        out = self.module(hidden, self.target.embed(tokens))
        return self.norm(out)

    @torch.inference_mode()
    def draft(
        self, hidden: torch.Tensor, first: torch.Tensor, k: int, with_logits: bool = True
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Greedy chain: returns (R, k) draft tokens and the k (R, V) float32 logits they were taken from
        (none without ``with_logits``: a greedy readout needs only the tokens, which come out the same)."""
        tokens, logits = [], []
        tok = first
        for _ in range(k):
            hidden = self.step(hidden, tok)
            tok, lg = self.logits.draft(hidden, with_logits)
            tokens.append(tok)
            if lg is not None:
                logits.append(lg)
        return torch.stack(tokens, dim=1), logits


def read_config(weights: Path) -> MTPConfig:
    return read_head_config(MTPConfig, weights)


def save_mtp(module: MTPModule, weights: Path, dtype: torch.dtype = torch.float32) -> None:
    """Writes the tensors in ``dtype`` (bfloat16 halves the file; the engine casts to its own dtype)."""
    save_head(module, module.config, weights, dtype, "mtp")


def load_mtp(weights: Path, dtype: torch.dtype = torch.float32, device="cpu") -> MTPModule:
    """Reads the config and tensors; a missing, unexpected or misshapen tensor raises ValueError."""
    return load_head(MTPModule, read_config(weights), weights, "MTP", dtype, device)
