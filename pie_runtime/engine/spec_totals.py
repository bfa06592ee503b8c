"""Speculative-decoding counters summed over finished runs, per model and inferlet, for ``stats``.

Speculation lives in inferlets, so only they know what was drafted and kept; each reports its run's
counters when it ends (``spec_report``) and the engine adds them up here. The counters and the figures
derived from them are the ones a run's own ``stats`` uses (protocol/spec_counters.py), so a dashboard
reads one run and the engine's totals alike.

The totals are shared engine state that any client writes, so they are bounded: at most
``MAX_INFERLETS`` inferlet names per model (the first ones reported; later names are summed under
``OTHER``), skip reasons from the fixed set the SDK uses (``SKIP_REASONS``; any other reason is summed under
``OTHER``, not refused, so a user's inferlet can name its own), and sums that saturate (spec_counters.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol import messages as m
from ..protocol.spec_counters import MAX_TOTAL, SpecCounters, add_capped

MAX_INFERLETS = 64  # distinct inferlet names kept per model; the rest are summed under OTHER
OTHER = "other"
SKIP_REASONS = frozenset(
    {
        "no_draft",  # the drafter had nothing to propose
        "draft_cost",  # the planner expected a plain step to be faster
        "last_token",  # only the bonus token was left to emit
        "near_capacity",  # a full verify window would not fit
        "penalties",  # fallbacks: sampling a run never speculates with (args.fallback_reasons)
        "logit_bias",
        "logprobs",
        "granule",  # the model's state advances in granules of more than one row: one token a step
        OTHER,
    }
)


@dataclass
class SpecTotals(SpecCounters):
    runs: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    prefill_ms: float = 0.0

    def add(self, r: m.SpecReport) -> None:
        """Adds one (validated) report; unknown skip reasons count under ``OTHER``."""
        counters = SpecCounters(**r.model_dump(include=SpecCounters.names() - {"skipped"}))
        for reason, n in r.skipped.items():
            key = reason if reason in SKIP_REASONS else OTHER
            counters.skipped[key] = add_capped(counters.skipped.get(key, 0), n)
        self.runs = add_capped(self.runs, 1)
        self.merge(counters)
        self.decode_tokens = add_capped(self.decode_tokens, r.decode_tokens)
        self.decode_s = min(self.decode_s + r.decode_s, float(MAX_TOTAL))  # finite: each report is <= 1e12
        self.prefill_ms = min(self.prefill_ms + r.prefill_ms, float(MAX_TOTAL))

    def as_dict(self) -> dict:
        return {
            "runs": self.runs,
            **self.figures(),
            "proposed_per_position": list(self.proposed_per_position),  # raw counts (the server's /metrics)
            "accepted_per_position": list(self.accepted_per_position),
            "reached_per_position": list(self.reached_per_position),
            "decode_tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            "prefill_ms": self.prefill_ms / self.runs if self.runs else 0.0,  # mean per run
        }


def totals_for(by_inferlet: dict[str, SpecTotals], inferlet: str) -> SpecTotals:
    """The totals ``inferlet`` reports into: its own while fewer than ``MAX_INFERLETS`` names are kept, else
    those of ``OTHER``."""
    if inferlet not in by_inferlet and len(by_inferlet) >= MAX_INFERLETS:
        inferlet = OTHER
    return by_inferlet.setdefault(inferlet, SpecTotals())
