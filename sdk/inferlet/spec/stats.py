"""A speculative run's counters (``SpecStats``): rounds, drafts proposed and kept (overall and per position),
tree rounds, and the steps that did not speculate with their reasons; summed over an n > 1 run's choices."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pie_runtime.protocol.spec_counters import SpecCounters

from .verify import VerifyResult

if TYPE_CHECKING:
    from .token_tree import TreeVerdict


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
