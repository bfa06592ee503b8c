"""Speculative verification: which drafted tokens a target model keeps.

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling".

A round drafts k tokens d_0..d_{k-1} cheaply, then runs the target once over the verify window
[last, d_0..d_{k-1}] with a readout on every row, giving p_0..p_k: p_i is the target's next-token
distribution at row i, so p_i is what d_i is judged by and p_k follows the last draft. q_i is the
drafter's distribution that d_i was drawn from. The rule:

    for i in 0..k-1:
        if uniform() < min(1, p_i(d_i) / q_i(d_i)):  emit d_i                       # accepted
        else: emit x ~ normalize(max(0, p_i - q_i)); stop                            # recovered
    emit x ~ p_k                                                                     # bonus

Every emitted token is then distributed exactly as the target samples it. Terms:
    accepted token   a draft the target kept (counted in `VerifyResult.accepted`);
    recovered token  the token sampled from the residual max(0, p_i - q_i) at the first rejection;
    bonus token      the token sampled from p_k when all k drafts were accepted.
Each round emits its accepted tokens plus exactly one recovered-or-bonus token.

Point-mass drafts (prompt lookup, an MTP head's argmax) have q_i = one-hot(d_i): accept with
probability p_i(d_i), on rejection sample p_i with d_i zeroed. A residual with no mass left falls
back to p_i. Greedy decoding (temperature 0) is
the special case where every p_i is one-hot, which `verify_greedy` does without probabilities.

p and q must come from the same `filter_distribution` (inferlet.spec.distribution: same temperature, top-k,
top-p, mask). A run's counters are inferlet.spec.stats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .distribution import sample_index


@dataclass
class VerifyResult:
    """One verify round: `tokens` is the accepted drafts then one recovered-or-bonus token."""

    tokens: list[int]
    accepted: int
    proposed: int


def verify_greedy(drafts: Sequence[int], target_tokens: Sequence[int] | np.ndarray) -> VerifyResult:
    """Greedy verification; target_tokens[i] is the target's argmax at window row i (len k+1)."""
    k = len(drafts)
    if len(target_tokens) != k + 1:
        raise ValueError(f"need {k + 1} target tokens for {k} drafts, got {len(target_tokens)}")
    accepted = 0
    while accepted < k and int(drafts[accepted]) == int(target_tokens[accepted]):
        accepted += 1
    tokens = [int(t) for t in drafts[:accepted]] + [int(target_tokens[accepted])]
    return VerifyResult(tokens=tokens, accepted=accepted, proposed=k)


def verify_sampled(
    drafts: Sequence[int],
    p: np.ndarray,
    q: np.ndarray | None,
    rng: np.random.Generator,
) -> VerifyResult:
    """Speculative sampling (module docstring) for one row.

    p: (k+1, V) target probabilities per window row. q: (k, V) drafter probabilities per draft
    position, or None when each draft is a point mass (lookup, MTP argmax).
    """
    k = len(drafts)
    p = np.asarray(p, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must be ({k + 1}, V), got {p.shape}")
    vocab = p.shape[1]
    if q is not None:
        q = np.asarray(q, dtype=np.float64)
        if q.shape != (k, vocab):
            raise ValueError(f"q must be ({k}, {vocab}), got {q.shape}")

    tokens: list[int] = []
    for i, d in enumerate(drafts):
        d = int(d)
        if not 0 <= d < vocab:
            raise ValueError(f"draft {d} outside vocabulary of {vocab}")
        p_d = p[i, d]
        q_d = 1.0 if q is None else q[i, d]
        # A draft its own drafter gave probability 0 carries no valid ratio: reject it.
        if q_d > 0 and rng.random() < min(1.0, p_d / q_d):
            tokens.append(d)
            continue
        if q is None:
            residual = p[i].copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p[i] - q[i], 0.0)
        if not residual.sum() > 0:
            residual = p[i]
        tokens.append(sample_index(residual, rng))
        return VerifyResult(tokens=tokens, accepted=i, proposed=k)
    tokens.append(sample_index(p[k], rng))
    return VerifyResult(tokens=tokens, accepted=k, proposed=k)
