"""Deprecated: the draft-length planner is three parts now: inferlet.spec.acceptance (AcceptanceEstimate),
inferlet.spec.pass_cost (PassCostModel) and inferlet.spec.draft_policy (DraftPolicy, the old DraftPlanner). The old
names work here for one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings

from .spec.draft_policy import FIRST_TIMING, TIMING_EVERY, DraftPolicy
from .spec.pass_cost import MAX_DISCOUNT, MIN_ROUND_MS, OVERHEAD_ROUNDS

DraftPlanner = DraftPolicy

__all__ = [
    "FIRST_TIMING",
    "MAX_DISCOUNT",
    "MIN_ROUND_MS",
    "OVERHEAD_ROUNDS",
    "TIMING_EVERY",
    "DraftPlanner",
    "DraftPolicy",
]

warnings.warn(
    "inferlet.draft_length moved to inferlet.spec (see its docstring)",
    DeprecationWarning,
    stacklevel=2,
)
