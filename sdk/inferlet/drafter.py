"""What a speculative inferlet plugs into the round loop (inferlet.decode): a ``Drafter`` proposes the drafts
of each round (a ``Proposal``) and may constrain, read and observe the round's fire around them."""

from __future__ import annotations

from collections.abc import Sequence
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
    """A round's drafts: a chain of ``tokens`` (with ``q``), or a token ``tree`` verified in one tree window."""

    tokens: list[int] = field(default_factory=list)
    q: np.ndarray | None = None  # (len(tokens), V) drafter probabilities; None for point-mass drafts
    tree: TokenTree | None = None

    @property
    def rows(self) -> int:
        """Draft rows of the verify window."""
        return len(self.tree) if self.tree is not None else len(self.tokens)


class Drafter:
    """What a speculative inferlet plugs into `speculate`. The defaults draft nothing."""

    draft_cost_ms: float = 0.0  # what proposing one more draft costs (a draft model's step); 0 for lookups
    # [i]: acceptance of draft i+1 given 1..i kept, known before the run (a head's training record): the
    # planner's prior; empty: none known
    acceptance_prior: Sequence[float] = ()
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
