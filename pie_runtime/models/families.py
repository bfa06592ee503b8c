"""The model class of each config: one table from architecture to module, so that importers, the store and
the engine build any family the same way."""

from __future__ import annotations

import torch
from torch import nn

from .config import AnyConfig, Lfm2Config, MambaConfig
from .lfm2 import Lfm2ForCausalLM
from .llama import LlamaForCausalLM
from .mamba import MambaForCausalLM
from .state_cache import StateShapes

CausalLM = LlamaForCausalLM | MambaForCausalLM | Lfm2ForCausalLM


def build_causal_lm(cfg: AnyConfig) -> CausalLM:
    if isinstance(cfg, MambaConfig):
        return MambaForCausalLM(cfg)
    if isinstance(cfg, Lfm2Config):
        return Lfm2ForCausalLM(cfg)
    return LlamaForCausalLM(cfg)


def state_shapes(cfg: AnyConfig) -> StateShapes:
    """Per recurrent layer, the shapes of one sequence's state tensors ({} for a model without any)."""
    if isinstance(cfg, MambaConfig):
        return MambaForCausalLM.state_shapes(cfg)
    if isinstance(cfg, Lfm2Config):
        return Lfm2ForCausalLM.state_shapes(cfg)
    return {}


def embedding_weight(model: CausalLM) -> torch.Tensor:
    """The input embedding matrix (what a tied lm head shares)."""
    if isinstance(model, MambaForCausalLM):
        return model.backbone.embeddings.weight
    return model.model.embed_tokens.weight


def final_norm(model: CausalLM) -> nn.Module:
    """The norm after the last layer (what an MTP head applies to its own output)."""
    if isinstance(model, MambaForCausalLM):
        return model.backbone.norm_f
    if isinstance(model, Lfm2ForCausalLM):
        return model.model.embedding_norm
    return model.model.norm


def norm_eps(cfg: AnyConfig) -> float:
    """The epsilon of the model's RMS norms (what an MTP head's own norms copy)."""
    if isinstance(cfg, MambaConfig):
        return cfg.layer_norm_epsilon
    if isinstance(cfg, Lfm2Config):
        return cfg.norm_eps
    return cfg.rms_norm_eps
