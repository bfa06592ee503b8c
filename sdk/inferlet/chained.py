"""A drafter whose drafts come back with the verify pass: an engine-side head (``MTP(k)`` or ``Eagle(k)``)
chains k drafts from the rows of each fire, and the next round proposes those from the row verification
kept going from. The EAGLE inferlet drafts with it."""

from __future__ import annotations

from collections.abc import Callable

from .drafter import Drafter, Proposal
from .forward import PassResult
from .readouts import ReadoutSpec
from .sampler import Verifier
from .speculative import VerifyResult

# (depth, at_accepted) → the readout that drafts, e.g. ``lambda k, acc: inferlet.Eagle(k, at_accepted=acc)``
HeadReadout = Callable[[int, bool], ReadoutSpec]


class ChainedDrafter(Drafter):
    """Each fire's head readout drafts the next round. Its depth follows the draft count the planner asked
    for last (a round late: this fire's drafts are next round's), since every level of depth costs a head
    step and an lm head whether or not its draft is used; before a round the planner will not draft in, the
    fire reads out no head at all. Greedy: the engine chains only from the row verification stops at
    (at_accepted). Sampled: every row chains from the target's argmax, and the drafts are kept only where
    the sampled token is that argmax."""

    def __init__(self, head: HeadReadout, k: int, step_ms: float = 0.0):
        self.head = head
        self.k = k
        self.depth = k
        self.next: list[int] = []
        self.draft_cost_ms = step_ms

    def readouts(self, verifier: Verifier) -> list[ReadoutSpec]:
        if self.k == 0 or (self.planner is not None and not self.planner.will_draft()):
            return [verifier.kind()]  # the next round is a plain step: no drafts to compute for it
        if verifier.greedy:
            return [self.head(self.depth, True)]
        return [verifier.kind(), self.head(self.depth, False)]

    def observe(self, res: PassResult, verified: VerifyResult) -> None:
        last = res.readouts[-1]
        if last.tokens is None or last.tokens.ndim != 2:  # no head readout this fire
            self.next = []
            return
        tokens = last.tokens[verified.accepted]  # (1+depth,) at the last accepted row
        drafts = [int(t) for t in tokens[1:]]
        self.next = drafts if int(tokens[0]) == verified.tokens[-1] and min(drafts, default=0) >= 0 else []

    async def propose(self, seq: list[int], k: int) -> Proposal:
        if self.k:
            self.depth = min(max(k, 1), self.k)
        return Proposal(self.next[:k])
