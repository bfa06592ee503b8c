"""The family registry: models as data. :data:`FAMILIES` maps each config's ``family`` to its spec (model
class, recurrent state shapes, where its embedding and final norm sit, its norm epsilon), so that importers,
the store and the engine build and inspect any family by one lookup; the Hugging Face ``model_type`` table is
config.py's :data:`~.config.HF_MODEL_TYPES`, the GGUF architecture table gguf_arch.py's ``ARCHITECTURES``.
Every Llama-family switch (Mistral's window, Qwen's biases and q/k norms, Gemma 3's recipe) is a
:class:`~.config.ModelConfig` field read per layer (:meth:`~.config.ModelConfig.layer_recipe`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .config import AnyConfig, UnsupportedModelError
from .lfm2 import Lfm2ForCausalLM
from .llama import LlamaForCausalLM
from .mamba import MambaForCausalLM
from .state_cache import StateShapes

CausalLM = LlamaForCausalLM | MambaForCausalLM | Lfm2ForCausalLM


@dataclass(frozen=True)
class FamilySpec:
    """What the runtime needs to know of a family beyond its config's fields."""

    model_class: Callable[[Any], CausalLM]
    state_shapes: Callable[[Any], StateShapes]  # per recurrent layer, one sequence's state tensors
    embedding: Callable[[Any], torch.Tensor]  # the input embedding matrix (what a tied lm head shares)
    final_norm: Callable[[Any], nn.Module]  # the norm after the last layer
    norm_eps: Callable[[Any], float]  # the epsilon of its RMS norms (what an MTP head's norms copy)


def _no_state(cfg: Any) -> StateShapes:
    return {}


_LLAMA = FamilySpec(
    model_class=LlamaForCausalLM,
    state_shapes=_no_state,
    embedding=lambda m: m.model.embed_tokens.weight,
    final_norm=lambda m: m.model.norm,
    norm_eps=lambda c: c.rms_norm_eps,
)
FAMILIES: dict[str, FamilySpec] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma3"), _LLAMA),
    "mamba": FamilySpec(
        model_class=MambaForCausalLM,
        state_shapes=MambaForCausalLM.state_shapes,
        embedding=lambda m: m.backbone.embeddings.weight,
        final_norm=lambda m: m.backbone.norm_f,
        norm_eps=lambda c: c.layer_norm_epsilon,
    ),
    "lfm2": FamilySpec(
        model_class=Lfm2ForCausalLM,
        state_shapes=Lfm2ForCausalLM.state_shapes,
        embedding=lambda m: m.model.embed_tokens.weight,
        final_norm=lambda m: m.model.embedding_norm,
        norm_eps=lambda c: c.norm_eps,
    ),
}


def family_spec(family: str) -> FamilySpec:
    spec = FAMILIES.get(family)
    if spec is None:
        raise UnsupportedModelError(f"unsupported model family {family!r}; supported: {', '.join(FAMILIES)}")
    return spec


def build_causal_lm(cfg: AnyConfig) -> CausalLM:
    return family_spec(cfg.family).model_class(cfg)


def state_shapes(cfg: AnyConfig) -> StateShapes:
    """Per recurrent layer, the shapes of one sequence's state tensors ({} for a model without any)."""
    return family_spec(cfg.family).state_shapes(cfg)


def embedding_weight(model: CausalLM) -> torch.Tensor:
    """The input embedding matrix (what a tied lm head shares)."""
    return family_spec(model.config.family).embedding(model)


def final_norm(model: CausalLM) -> nn.Module:
    """The norm after the last layer (what an MTP head applies to its own output)."""
    return family_spec(model.config.family).final_norm(model)


def norm_eps(cfg: AnyConfig) -> float:
    """The epsilon of the model's RMS norms (what an MTP head's own norms copy)."""
    return family_spec(cfg.family).norm_eps(cfg)
