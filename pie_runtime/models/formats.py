"""The names of the weight formats a model is served in, in one torch-free place: the CLI's flags, the store's
drafter entries and the benchmarks read them here without importing torch. What each format is (its layers,
its activations) is models/weights.py's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

# gguf: every tensor in its own stored GGUF kind on the native step (native_load.py); on torch's kernels as int4
WeightFormat = Literal["fp32", "bf16", "int8", "int4", "gguf"]
WEIGHT_FORMATS: tuple[WeightFormat, ...] = get_args(WeightFormat)
DEFAULT_WEIGHTS: WeightFormat = "int4"  # the GGUF's own 4-bit blocks: fastest, top-1 0.97 vs their fp32 dequantization
# the kinds int4 runs as they are (q8_0 on the 8-bit kernel); int4 requantizes any other kind from its float values
INT4_AS_STORED = frozenset({"q4_0", "q4_1", "q8_0"})


def default_format(stored_kinds: Iterable[str]) -> WeightFormat:
    """The format a model runs in when --weights names none: ``gguf`` where the model holds kinds that int4 would
    requantize (a Q4_K_M file: requantized to 4 bits per 32, Gemma 3 270M's top-1 left the float32 reference's
    at over a quarter of positions; docs/models.md), else DEFAULT_WEIGHTS, which runs the same kernels then."""
    return "gguf" if set(stored_kinds) - INT4_AS_STORED else DEFAULT_WEIGHTS
