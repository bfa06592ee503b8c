"""Rotary position embeddings (Su et al. 2021) in Hugging Face's rotate-half layout, with the Llama-3, linear
and ``freq_factors`` (a GGUF's ``rope_freqs.weight``) ``rope_scaling`` variants."""

from __future__ import annotations

import math
from typing import Any

import torch

from .config import Lfm2Config, ModelConfig, UnsupportedModelError


def inverse_frequencies(
    cfg: ModelConfig | Lfm2Config, base: float | None = None, scaling: dict[str, Any] | None | bool = True
) -> torch.Tensor:
    """(head_dim // 2,) float64 inverse frequencies after any rope scaling. ``base`` and ``scaling``: a layer
    kind's own (:meth:`ModelConfig.layer_rope`) where they are not the config's."""
    dim = cfg.head_dim
    # on the CPU whatever the default device: a model built on the meta device still needs real tables
    inv = 1.0 / ((base or cfg.rope_theta) ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    if scaling is True:
        scaling = cfg.rope_scaling
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "freq_factors":  # a GGUF's rope_freqs.weight: one divisor per frequency (llama.cpp's Llama 3.x)
        factors = torch.tensor(scaling["factors"], dtype=torch.float64, device="cpu")
        if factors.shape != inv.shape:
            raise UnsupportedModelError(f"rope freq_factors has {factors.numel()} values, head_dim needs {inv.numel()}")
        return inv / factors
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r}")


class Rotary:
    """cos/sin for arbitrary per-row positions, computed once per forward and shared by every layer."""

    def __init__(
        self, cfg: ModelConfig | Lfm2Config, base: float | None = None, scaling: dict[str, Any] | None | bool = True
    ):
        self.inv_freq = inverse_frequencies(cfg, base, scaling).float()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)  # (N, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (N, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, heads, D); cos/sin: (N, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
