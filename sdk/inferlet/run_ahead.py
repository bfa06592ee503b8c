"""Deprecated: moved to inferlet.spec.run_ahead. The old names work here for one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings

from .spec.run_ahead import OUTPUT_CELLS, TAKE_AT_LEAST, RunAhead

__all__ = ["OUTPUT_CELLS", "TAKE_AT_LEAST", "RunAhead"]

warnings.warn("inferlet.run_ahead moved to inferlet.spec (see its docstring)", DeprecationWarning, stacklevel=2)
