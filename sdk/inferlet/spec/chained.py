"""A drafter whose drafts come back with the verify pass: an engine-side head (``MTP(k)`` or ``Eagle(k)``)
chains drafts from the rows of each fire, and the next round proposes those from the row verification kept
going from. The EAGLE inferlet drafts with it; the MTP inferlet builds its tree and lookup modes on it.

    readouts()   the fire being built reads the head at depth chain_depth() (0: the next round is plain)
    observe()    the head's tokens at the last kept row: column 0 the target's argmax there, then the chain;
                 kept as the next round's drafts when column 0 is the emitted token
    propose(k)   the first k of them
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..forward import PassResult
from ..readouts import ReadoutSpec
from .drafter import Drafter, Proposal
from .token_tree import TreeVerdict
from .verifier import Verifier
from .verify import VerifyResult

# (depth, at_accepted) → the readout that drafts, e.g. ``lambda k, acc: inferlet.Eagle(k, at_accepted=acc)``
HeadReadout = Callable[[int, bool], ReadoutSpec]


class ChainedDrafter(Drafter):
    """Each fire's head readout drafts the next round. Its depth is the policy's (``DraftPolicy.chain_depth``):
    every level costs a head step and an lm head whether or not its draft is used, so the depth is weighed over
    this round's possible verdicts; before a round the policy will not draft in, the fire reads no head at all.
    Greedy: the engine chains only from the row verification stops at (at_accepted). Sampled: every row chains
    from the target's argmax, and the drafts are kept only where the sampled token is that argmax."""

    def __init__(self, head: HeadReadout, k: int, step_ms: float = 0.0, acceptance: Sequence[float] = ()):
        self.head = head
        self.k = k
        self.proposed = 0  # chain drafts the fire being built verifies
        self.next: list[int] = []
        self.chained: int | None = None  # head steps the fire being built reads (None: no readouts asked yet)
        self.draft_cost_ms = step_ms
        self.acceptance_prior = acceptance  # the head's training record (Model.mtp_acceptance, eagle_acceptance)

    def chain_depth(self) -> int:
        """The drafts the head readout of the fire being built chains for the next round: at most ``k``, the
        policy's choice over this round's verdicts (all ``k`` without a policy), 0 for none. Remembered as the
        steps this round pays (``draft_steps``)."""
        depth = self.k if self.k == 0 or self.planner is None else min(self.k, self.planner.chain_depth(self.proposed))
        if self.planner is not None and self.k:
            self.chained = depth
        return depth

    def draft_steps(self, proposal: Proposal) -> int:
        steps = proposal.rows if self.chained is None else self.chained
        self.chained = None
        return steps

    def chain_readouts(self, verifier: Verifier, depth: int, at_accepted: bool = True) -> list[ReadoutSpec]:
        """The readouts of a fire that chains ``depth`` drafts: the head alone when greedy and chaining from the
        kept row (its column 0 is the argmax the verdict reads), else the verifier's readout and the head."""
        if depth == 0:
            return [verifier.kind()]  # the next round is a plain step: no drafts to compute for it
        if verifier.greedy and at_accepted:
            return [self.head(depth, True)]
        return [verifier.kind(), self.head(depth, False)]

    def readouts(self, verifier: Verifier) -> list[ReadoutSpec]:
        return self.chain_readouts(verifier, self.chain_depth())

    @staticmethod
    def head_tokens(res: PassResult, verified: VerifyResult | TreeVerdict) -> np.ndarray | None:
        """The head's (1+depth,) tokens at the last kept row when they continue from the emitted token; None
        when the fire read no head, or the emitted token is not the head's column 0 (a sampled token)."""
        last = res.readouts[-1]
        if last.tokens is None or last.tokens.ndim != 2:  # no head readout this fire
            return None
        row = verified.path[-1] if isinstance(verified, TreeVerdict) else verified.accepted
        tokens = last.tokens[row]
        if int(tokens[0]) != verified.tokens[-1] or min(tokens[1:], default=0) < 0:
            return None
        return tokens

    def observe(self, res: PassResult, verified: VerifyResult | TreeVerdict) -> None:
        self.proposed = 0
        tokens = self.head_tokens(res, verified)
        self.next = [] if tokens is None else [int(t) for t in tokens[1:]]

    async def propose(self, seq: list[int], k: int) -> Proposal:
        drafts = self.next[:k]
        self.proposed = len(drafts)
        return Proposal(drafts)
