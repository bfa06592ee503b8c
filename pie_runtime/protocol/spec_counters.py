"""The counters of speculative decoding and the figures derived from them, one definition for both sides:
a run keeps them in its ``stats`` (SDK) and reports them when it ends (``spec_report``); the engine sums the
reports per model and inferlet. Same names, same meanings: `accepted` counts drafts kept, not tokens
returned; acceptance is drafts kept over drafts proposed.

Sums saturate at ``MAX_TOTAL`` (the largest msgpack int64), so summed reports can never make a ``stats``
reply unencodable; each report's counts are below 2**53 (``messages.SpecReport``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

MAX_TOTAL = 2**63 - 1


def add_capped(a: int, b: int) -> int:
    """``a + b``, saturating at ``MAX_TOTAL``."""
    return min(a + b, MAX_TOTAL)


@dataclass
class SpecCounters:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_per_position: list[int] = field(default_factory=list)  # [i]: rounds with >= i+1 drafts
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds keeping draft i+1
    # [i]: rounds that verified draft i+1 with drafts 1..i kept: the denominator of the acceptance a training
    # record, the planner and the agreement eval speak of (draft i+1 given the ones before it)
    reached_per_position: list[int] = field(default_factory=list)
    rounds_with_rejection: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason → plain steps
    # rows the engine replayed to fold fewer rows than a fire ran (models with recurrent state: engine/fold.py)
    replayed_rows: int = 0
    draft_rows: int = 0  # draft rows of every round's verify window (a chain's drafts, a tree's nodes), summed
    tree_rounds: int = 0  # rounds that verified a token tree (counted in rounds too)
    tree_rows: int = 0  # draft rows of those rounds' windows, summed
    tree_depth: int = 0  # depth of the path each kept, summed (its accepted drafts)

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(SpecCounters)}

    def add_positions(self, proposed: list[int], accepted: list[int], reached: list[int]) -> None:
        """Adds per-position counts (three lists of one length), growing the lists to the longer length."""
        grow = len(proposed) - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
            self.reached_per_position.extend([0] * grow)
        for i, (p, a, r) in enumerate(zip(proposed, accepted, reached, strict=True)):
            self.proposed_per_position[i] = add_capped(self.proposed_per_position[i], p)
            self.accepted_per_position[i] = add_capped(self.accepted_per_position[i], a)
            self.reached_per_position[i] = add_capped(self.reached_per_position[i], r)

    def merge(self, other: SpecCounters) -> None:
        self.rounds = add_capped(self.rounds, other.rounds)
        self.proposed = add_capped(self.proposed, other.proposed)
        self.accepted = add_capped(self.accepted, other.accepted)
        self.add_positions(other.proposed_per_position, other.accepted_per_position, other.reached_per_position)
        self.rounds_with_rejection = add_capped(self.rounds_with_rejection, other.rounds_with_rejection)
        self.replayed_rows = add_capped(self.replayed_rows, other.replayed_rows)
        for reason, n in other.skipped.items():
            self.skipped[reason] = add_capped(self.skipped.get(reason, 0), n)
        self.draft_rows = add_capped(self.draft_rows, other.draft_rows)
        self.tree_rounds = add_capped(self.tree_rounds, other.tree_rounds)
        self.tree_rows = add_capped(self.tree_rows, other.tree_rows)
        self.tree_depth = add_capped(self.tree_depth, other.tree_depth)

    def figures(self) -> dict:
        """The counters and what dashboards read from them."""
        return {
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance": self.accepted / self.proposed if self.proposed else 0.0,
            "acceptance_per_position": [
                a / n if n else 0.0 for a, n in zip(self.accepted_per_position, self.proposed_per_position)
            ],
            # draft i+1 kept given 1..i were (what a training record's held-out acceptance and the planner mean)
            "acceptance_given_kept": [
                a / n if n else 0.0 for a, n in zip(self.accepted_per_position, self.reached_per_position)
            ],
            "rejecting_round_share": self.rounds_with_rejection / self.rounds if self.rounds else 0.0,
            "replayed_rows": self.replayed_rows,
            "skipped": dict(self.skipped),
            "rows_per_round": 1 + self.draft_rows / self.rounds if self.rounds else 0.0,  # verify window rows, mean
            "accepted_depth": self.accepted / self.rounds if self.rounds else 0.0,  # drafts kept per round, mean
            "tree_rounds": self.tree_rounds,
            "tree_rows": self.tree_rows / self.tree_rounds if self.tree_rounds else 0.0,  # mean rows a tree round
            "tree_depth": self.tree_depth / self.tree_rounds if self.tree_rounds else 0.0,  # mean accepted depth
        }
