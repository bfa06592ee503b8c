"""The names of the weight formats a model is served in, in one torch-free place: the CLI's flags, the store's
drafter entries and the benchmarks read them here without importing torch. What each format is (its layers,
its activations) is models/weights.py's."""

from __future__ import annotations

from typing import Literal, get_args

# gguf: every tensor in its own stored GGUF kind on the native step (native_load.py); on torch's kernels as int4
WeightFormat = Literal["fp32", "bf16", "int8", "int4", "gguf"]
WEIGHT_FORMATS: tuple[WeightFormat, ...] = get_args(WeightFormat)
DEFAULT_WEIGHTS: WeightFormat = "int4"  # the GGUF's own 4-bit blocks: fastest, top-1 0.97 vs their fp32 dequantization
