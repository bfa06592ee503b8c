"""Deprecated: the round loop moved to inferlet.spec: Run to inferlet.spec.rounds, drive_rounds and fit_tree to
inferlet.spec.drafting, speculate to inferlet.spec.host_rounds. The old names work here for one release, with a
DeprecationWarning."""

from __future__ import annotations

import warnings

from .spec.drafting import Step, drive_rounds, fit_tree
from .spec.host_rounds import speculate
from .spec.rounds import Run

__all__ = ["Run", "Step", "drive_rounds", "fit_tree", "speculate"]

warnings.warn(
    "inferlet.decode moved to inferlet.spec (see its docstring)",
    DeprecationWarning,
    stacklevel=2,
)
