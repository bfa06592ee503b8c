"""Deprecated: split: filter_distribution to inferlet.spec.distribution, verification (VerifyResult, verify_greedy,
verify_sampled) to inferlet.spec.verify, SpecStats to inferlet.spec.stats. The old names work here for one release,
with a DeprecationWarning."""

from __future__ import annotations

import warnings

from .spec.distribution import filter_distribution
from .spec.stats import SpecStats
from .spec.verify import VerifyResult, verify_greedy, verify_sampled

__all__ = ["SpecStats", "VerifyResult", "filter_distribution", "verify_greedy", "verify_sampled"]

warnings.warn(
    "inferlet.speculative moved to inferlet.spec (see its docstring)",
    DeprecationWarning,
    stacklevel=2,
)
