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

p and q must come from the same `filter_distribution` (same temperature, top-k, top-p, mask); that
function is the reference the engine's torch sampler implements (`pie_runtime/engine/sampling.py`), with
the same guards: whatever the logits (NaN, +-inf), every row is finite, non-negative and sums to 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pie_runtime.protocol.messages import MAX_TEMPERATURE, MIN_TEMPERATURE
from pie_runtime.protocol.spec_counters import SpecCounters

if TYPE_CHECKING:
    from .tree import TreeVerdict


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
        tokens.append(_sample(residual, rng))
        return VerifyResult(tokens=tokens, accepted=i, proposed=k)
    tokens.append(_sample(p[k], rng))
    return VerifyResult(tokens=tokens, accepted=k, proposed=k)


def _sample(weights: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn proportionally to non-negative `weights` (need not sum to 1)."""
    cdf = np.cumsum(weights)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    # u * total can round up to total; never return a zero-weight index.
    return min(i, int(np.flatnonzero(weights > 0)[-1]))


class SpecStats(SpecCounters):
    """Counters over a speculative run; `accepted` counts drafts kept, not tokens returned."""

    def record(self, result: VerifyResult) -> None:
        self.rounds += 1
        self.proposed += result.proposed
        self.draft_rows += result.proposed
        self.accepted += result.accepted
        p, a = result.proposed, result.accepted
        reached = min(p, a + 1)  # the kept drafts and the one it stopped at
        self.add_positions([1] * p, [1] * a + [0] * (p - a), [1] * reached + [0] * (p - reached))
        if result.accepted < result.proposed:
            self.rounds_with_rejection += 1

    def record_tree(self, verdict: TreeVerdict, depth: int) -> None:
        """A verified tree round: its draft rows, and the depth of the path it kept; as a chain round would
        count, it proposed one draft per depth of the tree (``depth``) and accepted the kept path's."""
        self.record(VerifyResult(verdict.tokens, verdict.accepted, depth))
        self.draft_rows += verdict.rows - 1 - depth
        self.tree_rounds += 1
        self.tree_rows += verdict.rows - 1
        self.tree_depth += verdict.accepted

    def skip(self, reason: str) -> None:
        """Count a step that did not speculate, e.g. 'penalties', 'near_capacity', 'no_draft'."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def as_dict(self, decode_tokens_per_s: float, prefill_ms: float) -> dict:
        return {**self.figures(), "decode_tokens_per_s": decode_tokens_per_s, "prefill_ms": prefill_ms}

    def summary(self) -> dict:
        """A run's ``speculation`` result: the counts, acceptance (drafts kept over proposed), ``per_position``
        (acceptance of draft i+1 over the rounds that proposed it), ``skipped`` (reason → plain steps: a fallback
        run counts its reason, "penalties", "logit_bias" or "logprobs", on every step), and the per-position
        counts, from which ``from_summary`` rebuilds the counters (summing the choices of an n > 1 run)."""
        f = self.figures()
        return {
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance": f["acceptance"],
            "per_position": f["acceptance_per_position"],
            "skipped": dict(self.skipped),
            "rounds_with_rejection": self.rounds_with_rejection,
            "replayed_rows": self.replayed_rows,
            "proposed_per_position": list(self.proposed_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "reached_per_position": list(self.reached_per_position),
            "draft_rows": self.draft_rows,
            "tree_rounds": self.tree_rounds,
            "tree_rows": self.tree_rows,
            "tree_depth": self.tree_depth,
        }

    @classmethod
    def from_summary(cls, d: dict) -> SpecStats:
        return cls(
            rounds=d["rounds"],
            proposed=d["proposed"],
            accepted=d["accepted"],
            proposed_per_position=list(d["proposed_per_position"]),
            accepted_per_position=list(d["accepted_per_position"]),
            reached_per_position=list(d["reached_per_position"]),
            rounds_with_rejection=d["rounds_with_rejection"],
            skipped=dict(d["skipped"]),
            replayed_rows=int(d.get("replayed_rows", 0)),
            draft_rows=d.get("draft_rows", 0),
            tree_rounds=d.get("tree_rounds", 0),
            tree_rows=d.get("tree_rows", 0),
            tree_depth=d.get("tree_depth", 0),
        )
