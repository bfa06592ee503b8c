"""Deprecated: moved to inferlet.spec.chained (a chained drafter chooses its depth with
``ChainedDrafter.chain_depth``). The old names work here for one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings

from .spec.chained import ChainedDrafter, HeadReadout
from .spec.drafter import Drafter

__all__ = ["ChainedDrafter", "HeadReadout", "next_depth"]

warnings.warn("inferlet.chained: moved to inferlet.spec.chained", DeprecationWarning, stacklevel=2)


def next_depth(drafter: Drafter, proposed: int, k: int) -> int:
    """The drafts a head readout should chain for the next round: at most ``k``, the policy's choice over this
    round's verdicts (all ``k`` without a policy). Prefer ``ChainedDrafter.chain_depth``."""
    if k == 0 or drafter.planner is None:
        return k
    return min(k, drafter.planner.chain_depth(proposed))
