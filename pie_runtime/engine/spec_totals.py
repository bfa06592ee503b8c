"""Speculative-decoding counters summed over finished runs, per model and inferlet, for ``stats``.

Speculation lives in inferlets, so only they know what was drafted and kept; each reports its run's
counters when it ends (``spec_report``) and the engine adds them up here. The counters and the figures
derived from them are the ones a run's own ``stats`` uses (protocol/spec_counters.py), so a dashboard
reads one run and the engine's totals alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol import messages as m
from ..protocol.spec_counters import SpecCounters


@dataclass
class SpecTotals(SpecCounters):
    runs: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    prefill_ms: float = 0.0

    def add(self, r: m.SpecReport) -> None:
        self.runs += 1
        self.merge(SpecCounters(**r.model_dump(include=SpecCounters.names())))
        self.decode_tokens += r.decode_tokens
        self.decode_s += r.decode_s
        self.prefill_ms += r.prefill_ms

    def as_dict(self) -> dict:
        return {
            "runs": self.runs,
            **self.figures(),
            "decode_tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            "prefill_ms": self.prefill_ms / self.runs if self.runs else 0.0,  # mean per run
        }
