"""Readout kernels on the device: logits → argmax, filtered distribution, seeded samples.

``filtered_probs`` is the engine's twin of the SDK's ``inferlet.speculative.filter_distribution``: the
same temperature → top-k → top-p → mask order, the same greedy one-hot at temperature 0 (ties go to the
lowest index), so p and q computed on either side agree.
"""

from __future__ import annotations

import torch


def unpack_mask(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, ceil(V/32)) int32 words → (R, V) bool; bit i of word j allows token 32 j + i."""
    bits = torch.arange(32, device=packed.device, dtype=torch.int64)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool()  # (R, W, 32)
    return allowed.reshape(packed.shape[0], -1)[:, :vocab]


def masked_logits(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return logits
    return logits.masked_fill(~mask, float("-inf"))


def argmax(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    # torch.argmax returns the first maximal index, the SDK's tie rule
    return masked_logits(logits, mask).argmax(dim=-1)


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(R, V) logits → (R, V) float32 probabilities after temperature, top-k, top-p and the mask."""
    logits = masked_logits(logits.float(), mask)
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly ahead of each token
        keep_sorted = before < top_p  # the smallest prefix reaching top_p; the first token always stays
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, seed: int | None) -> torch.Tensor:
    gen = None
    if seed is not None:
        gen = torch.Generator(device=probs.device).manual_seed(seed)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)
