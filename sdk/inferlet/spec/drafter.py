"""What a speculative inferlet plugs into the round loop (inferlet.spec.rounds): a ``Drafter`` proposes the
drafts of each round (a ``Proposal``) and may constrain, read and observe the round's fire around them. It may
read the run's draft-length policy (``planner``: whether a tree pays, how deep a head should chain), never
write into it: what the loop needs from a drafter it asks (``draft_steps``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..forward import PassResult
from ..readouts import ReadoutSpec
from .draft_policy import DraftPolicy
from .token_tree import TokenTree, TreeVerdict
from .verifier import Verifier
from .verify import VerifyResult


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
    planner: DraftPolicy | None = None  # the run's draft-length policy, set by the round loop; read it only

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

    def tree_pays(self, widths: list[int], rows: int, draft_fires: int = 0) -> bool:
        """Whether the run's policy expects a tree of ``widths`` (``rows`` draft rows, ``draft_fires`` drafter
        steps) to emit more tokens per ms than the best chain; True without a policy (a fixed schedule)."""
        return self.planner is None or self.planner.use_tree(widths, rows, draft_fires)

    def draft_steps(self, proposal: Proposal) -> int:
        """The drafter steps the round that verified ``proposal`` paid for (the policy prices its time with
        them): one a draft row, unless a head's chain read another count in the round's fire."""
        return proposal.rows

    async def commit(self, new_tokens: list[int], seq: list[int], committed: int) -> None:
        """After each step: the tokens it emitted, the sequence now, the target's committed rows."""

    async def close(self) -> None:
        pass
