"""Readout kernels on the device: logits → argmax, filtered distribution, seeded samples.

``filtered_probs`` is the engine's twin of the SDK's ``inferlet.spec.distribution.filter_distribution``: the
same mask → temperature → top-k → top-p order, the same greedy one-hot below ``MIN_TEMPERATURE`` (ties go
to the lowest index), so p and q computed on either side agree.

No input can make them produce NaN or inf (and so crash ``torch.multinomial``):
  - a NaN logit counts as -inf (never chosen while another token can be);
  - each row is shifted so its largest logit is 0 before the temperature divides it; a row with +inf
    logits is uniform over them, a row with no finite allowed logit uniform over its allowed tokens;
  - a temperature below ``MIN_TEMPERATURE`` (1e-4, 0 included) is greedy, one above ``MAX_TEMPERATURE``
    counts as ``MAX_TEMPERATURE`` (the wire refuses it anyway): a tiny temperature behaves as its limit;
  - top-p always keeps the most probable token, so a tiny top_p is greedy too, and the renormalising sum
    is never 0.
An all-zero mask row is refused at fire admission (``empty_mask``); should one reach the kernels, the row
counts as unmasked.
"""

from __future__ import annotations

import torch

from ..protocol.messages import MAX_TEMPERATURE, MIN_TEMPERATURE

NEG_INF = float("-inf")


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
    # torch.argmax returns the first maximal index, the SDK's tie rule; a NaN logit counts as -inf
    return masked_logits(logits.nan_to_num(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF), mask).argmax(dim=-1)


def _shifted(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(R, V) float32 logits with NaN as -inf and the mask applied, shifted so each row's largest is 0: a
    row with +inf logits becomes 0 at them, a row with no finite allowed logit 0 at its allowed tokens."""
    x = logits.float().nan_to_num(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
    allowed = torch.ones_like(x, dtype=torch.bool) if mask is None else mask
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)  # an empty mask row counts as unmasked
    x = x.masked_fill(~allowed, NEG_INF)
    top = x.amax(dim=-1, keepdim=True)
    zero, neg = torch.zeros_like(x), torch.full_like(x, NEG_INF)
    finite = torch.where(torch.isfinite(top), x - top, zero)  # no inf - inf here
    return torch.where(
        top == float("inf"),
        torch.where(x == float("inf"), zero, neg),
        torch.where(top == NEG_INF, torch.where(allowed, zero, neg), finite),
    )


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(R, V) logits → (R, V) float32 probabilities after the mask, temperature, top-k and top-p; every row
    finite, non-negative and summing to 1 whatever the logits (module docstring)."""
    x = _shifted(logits, mask)  # each row's largest is 0, the rest <= 0 or -inf
    if not temperature >= MIN_TEMPERATURE:  # 0, tiny (and NaN): greedy
        return torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[-1]).float()
    x = x / min(temperature, MAX_TEMPERATURE)  # still <= 0, the largest still 0
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, NEG_INF)
    probs = torch.softmax(x, dim=-1)  # exp(0) = 1 in every row: the sum is >= 1
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly ahead of each token
        keep_sorted = before < top_p  # the smallest prefix reaching top_p
        keep_sorted[:, 0] = True  # the first token always stays (top_p may round to 0 in float32)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)  # >= the kept largest, > 0
    return probs


def sample(probs: torch.Tensor, seed: int | None) -> torch.Tensor:
    gen = None
    if seed is not None:
        gen = torch.Generator(device=probs.device).manual_seed(seed)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)
