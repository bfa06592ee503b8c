"""Deprecated: moved to inferlet.spec.device_rounds. The old names work here for one release, with a
DeprecationWarning."""

from __future__ import annotations

import warnings

from .spec.device_rounds import accept, host_loop, mtp_first, mtp_round, mtp_run_ahead, on_device, replay, verify_rounds

__all__ = ["accept", "host_loop", "mtp_first", "mtp_round", "mtp_run_ahead", "on_device", "replay", "verify_rounds"]

warnings.warn("inferlet.device_rounds moved to inferlet.spec (see its docstring)", DeprecationWarning, stacklevel=2)
