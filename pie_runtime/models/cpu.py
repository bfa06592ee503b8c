"""What this CPU computes fast: the choices between equivalent kernels that depend on it."""

from __future__ import annotations

import functools

import torch


@functools.cache
def bf16_is_fast() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 / AMX); else bf16 is emulated and slow."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - an older torch without the probe
        return False
