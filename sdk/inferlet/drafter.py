"""What a speculative inferlet plugs into the round loop (inferlet.decode): a ``Drafter`` proposes the drafts
of each round (a ``Proposal``) and may constrain, read and observe the round's fire around them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .draft_length import DraftPlanner
from .forward import PassResult
from .readouts import ReadoutSpec
from .sampler import Verifier
from .speculative import VerifyResult
from .tree import TokenTree, TreeVerdict


@dataclass
class Proposal:
    """A round's drafts: a chain of ``tokens`` (with ``q``), or a token ``tree`` verified in one tree window.

    ``spare`` is the draft the drafter had after ``tokens`` but the round does not verify (the planner asked for
    fewer). Where every draft is kept, the target's own token is the one that draft would have been checked
    against, so the round loop scores it there and the planner learns the next position's acceptance without
    a row: otherwise a position the planner stopped drafting at would never be measured again. Point-mass
    drafts only (``q`` None): a sampled round keeps a draft with the target's probability of it, and its own
    token is drawn with that same probability."""

    tokens: list[int] = field(default_factory=list)
    q: np.ndarray | None = None  # (len(tokens), V) drafter probabilities; None for point-mass drafts
    tree: TokenTree | None = None
    spare: int | None = None

    @classmethod
    def chain(cls, drafts: list[int], k: int) -> Proposal:
        """The first ``k`` of ``drafts``, the one after them as the spare."""
        return cls(drafts[:k], spare=drafts[k] if len(drafts) > k else None)

    @property
    def rows(self) -> int:
        """Draft rows of the verify window."""
        return len(self.tree) if self.tree is not None else len(self.tokens)

    @property
    def spare_scored(self) -> bool:
        """Whether the round scores its spare: there is one and the drafts are point masses."""
        return self.spare is not None and self.q is None

    @property
    def scored(self) -> int:
        """Drafts the planner learns from when every verified one is kept: these, and the spare if scored."""
        return len(self.tokens) + self.spare_scored

    def verdict(self, emitted: list[int]) -> tuple[int, int]:
        """``DraftPlanner.observe``'s (drafts, kept) for a verified chain round that emitted ``emitted`` (the kept
        drafts and the target's own token): the spare counted as one more draft where it is scored and every
        verified draft was kept."""
        drafts, kept = len(self.tokens), len(emitted) - 1
        if not self.spare_scored or kept < drafts:
            return drafts, kept
        return drafts + 1, kept + (emitted[-1] == self.spare)


class Drafter:
    """What a speculative inferlet plugs into `speculate`. The defaults draft nothing."""

    draft_cost_ms: float = 0.0  # what proposing one more draft costs (a draft model's step); 0 for lookups
    planner: DraftPlanner | None = None  # the run's draft-length planner, set by the round loop

    async def prefill(self, prompt: list[int]) -> None:
        """Runs alongside the target's prefill (a draft model prefills its own working set here)."""

    async def propose(self, seq: list[int], k: int) -> Proposal:
        """Up to k drafts to follow ``seq`` (prompt and output so far; its last token is not yet in the cache)."""
        return Proposal()

    def masks(self, drafts: list[int]) -> np.ndarray | None:
        """(len(drafts)+1, ceil(V/32)) int32 masks of the verify rows, or None for no constraint."""
        return None

    def readouts(self, verifier: Verifier) -> list[ReadoutSpec]:
        """Readouts on every row of a fire; the first is verified (Argmax, Distribution, or MTP when greedy)."""
        return [verifier.kind()]

    def observe(self, res: PassResult, verified: VerifyResult | TreeVerdict) -> None:
        """Sees each fire's readouts and verdict (an MTP drafter keeps the next round's drafts from them)."""

    async def commit(self, new_tokens: list[int], seq: list[int], committed: int) -> None:
        """After each step: the tokens it emitted, the sequence now, the target's committed rows."""

    async def close(self) -> None:
        pass
