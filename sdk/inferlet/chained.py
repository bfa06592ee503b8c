"""A drafter whose drafts come back with the verify pass: an engine-side head (``MTP(k)`` or ``Eagle(k)``)
chains k drafts from the rows of each fire, and the next round proposes those from the row verification
kept going from. The EAGLE inferlet drafts with it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .drafter import Drafter, Proposal
from .forward import PassResult
from .readouts import ReadoutSpec
from .sampler import Verifier
from .speculative import VerifyResult

# (depth, at_accepted) → the readout that drafts, e.g. ``lambda k, acc: inferlet.Eagle(k, at_accepted=acc)``
HeadReadout = Callable[[int, bool], ReadoutSpec]


class ChainedDrafter(Drafter):
    """Each fire's head readout drafts the next round. Its depth is the planner's (``DraftPlanner.chain_depth``):
    every level costs a head step and an lm head whether or not its draft is used, so the depth is weighed
    over this round's possible verdicts; before a round the planner will not draft in, the fire reads out no
    head at all. Greedy: the engine chains only from the row verification stops at
    (at_accepted). Sampled: every row chains from the target's argmax, and the drafts are kept only where
    the sampled token is that argmax."""

    def __init__(self, head: HeadReadout, k: int, step_ms: float = 0.0, acceptance: Sequence[float] = ()):
        self.head = head
        self.k = k
        self.proposed = 0  # drafts the fire being built verifies
        self.next: list[int] = []
        self.draft_cost_ms = step_ms
        self.acceptance_prior = acceptance  # the head's training record (Model.eagle_acceptance)

    def readouts(self, verifier: Verifier) -> list[ReadoutSpec]:
        depth = next_depth(self, self.proposed, self.k)
        if depth == 0:
            return [verifier.kind()]  # the next round is a plain step: no drafts to compute for it
        if verifier.greedy:
            return [self.head(depth, True)]
        return [verifier.kind(), self.head(depth, False)]

    def observe(self, res: PassResult, verified: VerifyResult) -> None:
        self.proposed = 0
        last = res.readouts[-1]
        if last.tokens is None or last.tokens.ndim != 2:  # no head readout this fire
            self.next = []
            return
        tokens = last.tokens[verified.accepted]  # (1+depth,) at the last accepted row
        drafts = [int(t) for t in tokens[1:]]
        self.next = drafts if int(tokens[0]) == verified.tokens[-1] and min(drafts, default=0) >= 0 else []

    async def propose(self, seq: list[int], k: int) -> Proposal:
        drafts = self.next[:k]
        self.proposed = len(drafts)
        return Proposal(drafts)


def next_depth(drafter: Drafter, proposed: int, k: int) -> int:
    """The drafts a head readout in the fire being built should chain for the next round: at most the
    drafter's ``k``, the planner's choice over this round's verdicts (``DraftPlanner.chain_depth``; all ``k``
    without a planner), 0 for none."""
    if k == 0 or drafter.planner is None:
        return k
    depth = min(k, drafter.planner.chain_depth(proposed))
    drafter.planner.chained = depth  # the round's timing is priced with the steps this fire reads
    return depth
