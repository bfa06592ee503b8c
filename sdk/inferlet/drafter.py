"""Deprecated: moved to inferlet.spec.drafter. The old names work here for one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings

from .spec.drafter import Drafter, Proposal

__all__ = ["Drafter", "Proposal"]

warnings.warn("inferlet.drafter moved to inferlet.spec (see its docstring)", DeprecationWarning, stacklevel=2)
