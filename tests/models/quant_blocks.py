"""Random GGUF blocks of any quantized kind for the tests: random bytes with their float16 scale fields set to
finite values (gguf-py quantizes only the kinds of 32; the K kinds' blocks are made here, valid by layout)."""

from __future__ import annotations

import numpy as np

from pie_runtime.models.quant_kinds import KINDS, BlockTensor

# byte offsets of each kind's float16 fields (d, and m or dmin) inside a block
F16_FIELDS = {
    "q4_0": (0,),
    "q4_1": (0, 2),
    "q5_0": (0,),
    "q5_1": (0, 2),
    "q8_0": (0,),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
}


def random_blocks(kind: str, n: int, k: int, seed: int, scale: float = 0.01) -> BlockTensor:
    """An (n, k) weight of ``kind``: random values and sub-scales, float16 scales of about ``scale``."""
    rng = np.random.default_rng(seed)
    spec = KINDS[kind]
    raw = rng.integers(0, 256, size=(n * k // spec.block, spec.block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        d = (rng.standard_normal((raw.shape[0], 1)) * scale).astype(np.float16)
        raw[:, at : at + 2] = d.view(np.uint8)
    return BlockTensor.from_gguf(raw.reshape(n, -1), kind, (n, k))
