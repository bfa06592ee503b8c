"""Speculative-decoding counters summed over finished runs, per model and inferlet, for ``stats``.

Speculation lives in inferlets, so only they know what was drafted and kept; each reports its run's
counters when it ends (``spec_report``) and the engine adds them up here. The derived figures use the same
names and meanings as a run's own ``stats`` (acceptance is drafts kept over drafts proposed, and so on),
so a dashboard reads one run and the engine's totals alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..protocol import messages as m


@dataclass
class SpecTotals:
    runs: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    rounds_with_rejection: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    decode_tokens: int = 0
    decode_s: float = 0.0
    prefill_ms: float = 0.0

    def add(self, r: m.SpecReport) -> None:
        self.runs += 1
        self.rounds += r.rounds
        self.proposed += r.proposed
        self.accepted += r.accepted
        grow = len(r.proposed_per_position) - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i, (p, a) in enumerate(zip(r.proposed_per_position, r.accepted_per_position)):
            self.proposed_per_position[i] += p
            self.accepted_per_position[i] += a
        self.rounds_with_rejection += r.rounds_with_rejection
        for reason, n in r.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n
        self.decode_tokens += r.decode_tokens
        self.decode_s += r.decode_s
        self.prefill_ms += r.prefill_ms

    def as_dict(self) -> dict:
        return {
            "runs": self.runs,
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance": self.accepted / self.proposed if self.proposed else 0.0,
            "acceptance_per_position": [a / p if p else 0.0
                                        for a, p in zip(self.accepted_per_position, self.proposed_per_position)],
            "rejecting_round_share": self.rounds_with_rejection / self.rounds if self.rounds else 0.0,
            "skipped": dict(self.skipped),
            "decode_tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            "prefill_ms": self.prefill_ms / self.runs if self.runs else 0.0,  # mean per run
        }
