"""Sampling distributions: ``filter_distribution``, the reference the engine's torch sampler implements
(``pie_runtime/engine/sampling.py``), with the same guards: whatever the logits (NaN, +-inf), every row is finite,
non-negative and sums to 1; and ``sample_index``, one draw from non-negative weights."""

from __future__ import annotations

import numpy as np

from pie_runtime.protocol.messages import MAX_TEMPERATURE, MIN_TEMPERATURE


def filter_distribution(
    logits: np.ndarray,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """Logits (..., V) -> float64 probabilities (..., V), each row summing to 1.

    Steps, in order, per row:
      1. a NaN logit counts as -inf; mask: tokens where `mask` is False get probability 0 (mask
         broadcasts against logits; a row allowing no token is refused);
      2. shift the row so its largest logit is 0; a row with +inf logits is uniform over them, a row
         with no finite allowed logit uniform over its allowed tokens;
      3. temperature below MIN_TEMPERATURE (1e-4; 0 included): one-hot at the argmax, ties to the
         lowest index; otherwise divide by the temperature (at most MAX_TEMPERATURE);
      4. top-k (k > 0): keep every token whose logit is >= the k-th largest, so ties at the
         boundary are all kept;
      5. softmax over the kept tokens;
      6. top-p (< 1): sort by probability descending, ties by lower index first (a stable sort),
         and keep the shortest prefix whose mass is >= top_p; the first token is always kept, so a
         tiny top_p is greedy;
      7. renormalize.
    """
    x = np.array(logits, dtype=np.float64)
    if x.ndim == 0:
        raise ValueError("logits must have a vocabulary axis")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    allowed = np.ones(x.shape, dtype=bool)
    if mask is not None:
        allowed = np.broadcast_to(np.asarray(mask, dtype=bool), x.shape)
        if not allowed.any(axis=-1).all():
            raise ValueError("mask allows no token in some row")
    x = np.where(allowed & ~np.isnan(x), x, -np.inf)
    top = x.max(axis=-1, keepdims=True)
    finite = np.isfinite(top)
    with np.errstate(over="ignore"):  # a finite difference may overflow to -inf, which is fine
        shifted = x - np.where(finite, top, 0.0)  # no inf - inf
    x = np.where(
        top == np.inf,
        np.where(x == np.inf, 0.0, -np.inf),
        np.where(top == -np.inf, np.where(allowed, 0.0, -np.inf), shifted),
    )

    if not temperature >= MIN_TEMPERATURE:  # one-hot rows (not rows of an identity: V x V would be built)
        one_hot = np.zeros(x.shape, dtype=np.float64)
        np.put_along_axis(one_hot, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
        return one_hot

    with np.errstate(over="ignore"):  # a large negative logit may become -inf
        x = x / min(temperature, MAX_TEMPERATURE)  # still <= 0, the largest still 0
    if 0 < top_k < x.shape[-1]:
        kth = -np.partition(-x, top_k - 1, axis=-1)[..., top_k - 1 : top_k]  # (..., 1)
        x = np.where(x >= kth, x, -np.inf)

    probs = np.exp(x)  # exp(0) = 1 in every row: the sum is >= 1
    probs /= probs.sum(axis=-1, keepdims=True)

    if top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        # Mass strictly before each token: keep it while that is still short of top_p.
        before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = before < top_p
        keep_sorted[..., 0] = True
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample_index(weights: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn proportionally to non-negative `weights` (need not sum to 1)."""
    cdf = np.cumsum(weights)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    # u * total can round up to total; never return a zero-weight index.
    return min(i, int(np.flatnonzero(weights > 0)[-1]))
