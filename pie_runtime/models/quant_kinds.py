"""The one table of GGUF tensor kinds this project reads (:data:`KINDS`), and :class:`BlockTensor`, a 2-d weight
kept as its GGUF bytes: one row of ``row_bytes`` a weight row, blocks running along the row.

    | kind | weights/block | bytes/block | value          | native kernel (qmatmul.h; WX: sub-kind / scales)  |
    |------|---------------|-------------|----------------|---------------------------------------------------|
    | q4_0 | 32            | 18          | d (q - 8)      | WQ4 (alone) / WX a4 (q + 8, offset -8 d) / d       |
    | q4_1 | 32            | 20          | d q + m        | WQ4 (alone) / WX a4 / dm                           |
    | q5_0 | 32            | 22          | d (q - 16)     | WX a5 (q + 16, offset -16 d) / d                   |
    | q5_1 | 32            | 24          | d q + m        | WX a5 / dm                                         |
    | q8_0 | 32            | 34          | d q            | WQ8 (alone) / WX s16 / d                           |
    | q4_k | 256           | 144         | d sc q - dmin m (sub-blocks of 32) | WX a4 / k                     |
    | q5_k | 256           | 176         | d sc q - dmin m (sub-blocks of 32) | WX a5 / k                     |
    | q6_k | 256           | 210         | d sc (q - 32) (sub-blocks of 16)   | WX s6 (4 + 2-bit planes) / k  |
    | f16, bf16, f32 | 1   | 2, 2, 4     | the float      | quantized to Q8_0 at load                          |

Every quantized kind decomposes (:meth:`Kind.decompose`) into integer values, a scale per 16 values and, for
the affine kinds, an offset per 16: ``w = q * scale (+ offset)``, computed in float32 in the order
``gguf.quants.dequantize`` computes it, so :meth:`BlockTensor.dequantize` equals gguf's bit for bit. The native
packer repacks that decomposition into the kernel's records as it is (no rounding): the kinds of 32 keep their
float16 scales, the K kinds their float16 d and dmin per 256 with 8-bit sub-scales (:meth:`Kind.k_scales`,
mode ``k``), so a record is about the GGUF block's own size. Kinds outside the table
(IQ*, Q2_K, Q3_K, TQ*) are refused at import (:func:`check_supported`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from .quant import GroupQuant, QuantError

Decomposed = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # q (nb, block) int16, scale/offset (nb, block//16)
# a K kind's scales as stored: float16 (nb, 2) D0, D1 and int8 (nb, 8) a0, a1; record j's s0 = D0 a0[j], s1 = D1 a1[j]
KScales = tuple[np.ndarray, np.ndarray, np.ndarray]


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _per16(x: np.ndarray, block: int) -> np.ndarray:
    """A per-block (nb, 1) or per-sub-block (nb, s) float32 value repeated for each 16 values of the block."""
    return np.repeat(x, block // 16 // x.shape[1], axis=1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_x / Q5_x low nibbles: byte i holds value i (low) and value 16 + i (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 32 fifth bits in a little-endian uint32, bit i for value i."""
    bits = np.ascontiguousarray(qh).view(np.uint32)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)


def _q4_0(b: np.ndarray) -> Decomposed:
    return _nibbles(b[:, 2:]) - 8, _per16(_f16(b[:, :2]), 32), None


def _q4_1(b: np.ndarray) -> Decomposed:
    return _nibbles(b[:, 4:]), _per16(_f16(b[:, :2]), 32), _per16(_f16(b[:, 2:4]), 32)


def _q5_0(b: np.ndarray) -> Decomposed:
    return (_nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)) - 16, _per16(_f16(b[:, :2]), 32), None


def _q5_1(b: np.ndarray) -> Decomposed:
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
    return q, _per16(_f16(b[:, :2]), 32), _per16(_f16(b[:, 2:4]), 32)


def _q8_0(b: np.ndarray) -> Decomposed:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.int16), _per16(_f16(b[:, :2]), 32), None


def _k_ints(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 6-bit sc and m of the 8 sub-blocks (packed in 12 bytes), int8 (nb, 8)."""
    s = b[:, 4:16].reshape(-1, 3, 4)
    lo, hi, mix = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return sc.astype(np.int8), m.astype(np.int8)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: d sc and dmin m of the 8 sub-blocks, float32 (nb, 8)."""
    sc, m = _k_ints(b)
    return _f16(b[:, 0:2]) * sc.astype(np.float32), _f16(b[:, 2:4]) * m.astype(np.float32)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 4 runs of 32 bytes, run r holding values 64r + i (low nibble) and 64r + 32 + i (high)."""
    r = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (r & 0x0F).reshape(-1, 256).astype(np.int16)


def _q4_k(b: np.ndarray) -> Decomposed:
    dsc, dm = _k_scales(b)
    return _k_low(b[:, 16:]), _per16(dsc, 256), _per16(-dm, 256)


def _q5_k(b: np.ndarray) -> Decomposed:
    dsc, dm = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return _k_low(b[:, 48:]) | ((qh & 1).reshape(-1, 256).astype(np.int16) << 4), _per16(dsc, 256), _per16(-dm, 256)


def _q45_k_scales(b: np.ndarray) -> KScales:
    sc, m = _k_ints(b)
    d, dmin = np.ascontiguousarray(b[:, 0:2]).view(np.float16), np.ascontiguousarray(b[:, 2:4]).view(np.float16)
    return np.concatenate([d, -dmin], axis=1), sc, m


def _q6_k_scales(b: np.ndarray) -> KScales:
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
    d = np.ascontiguousarray(b[:, 208:210]).view(np.float16)
    return np.concatenate([d, d], axis=1), sc[:, 0::2], sc[:, 1::2]


def _q6_k(b: np.ndarray) -> Decomposed:
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 256)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 3).reshape(-1, 256)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return (ql | (qh << 4)).astype(np.int16) - 32, _f16(b[:, 208:210]) * sc, None


@dataclass(frozen=True)
class Kind:
    """One GGUF tensor kind: ``block`` weights in ``block_bytes`` bytes; ``decompose`` (quantized kinds) splits
    blocks into values, scales and offsets; ``native`` names the kernel record its blocks repack into (module
    docstring); ``float_dtype`` is a float kind's dtype."""

    name: str
    ggml_type: int
    block: int
    block_bytes: int
    native: str  # "s16" / "s6" (signed 8 / 6-bit values, a scale per 16), "a4" / "a5" (unsigned 4 / 5-bit,
    # scale + offset per 32)
    decompose: Callable[[np.ndarray], Decomposed] | None = None
    float_dtype: torch.dtype | None = None
    k_scales: Callable[[np.ndarray], KScales] | None = None  # the K kinds: scales as stored, for the packer

    @property
    def quantized(self) -> bool:
        return self.decompose is not None

    def row_bytes(self, k: int) -> int:
        if k % self.block:
            raise QuantError(f"{self.name} rows hold whole blocks of {self.block} weights, not {k}")
        return k // self.block * self.block_bytes


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("q4_0", 2, 32, 18, "a4", _q4_0),
        Kind("q4_1", 3, 32, 20, "a4", _q4_1),
        Kind("q5_0", 6, 32, 22, "a5", _q5_0),
        Kind("q5_1", 7, 32, 24, "a5", _q5_1),
        Kind("q8_0", 8, 32, 34, "s16", _q8_0),
        Kind("q4_k", 12, 256, 144, "a4", _q4_k, k_scales=_q45_k_scales),
        Kind("q5_k", 13, 256, 176, "a5", _q5_k, k_scales=_q45_k_scales),
        Kind("q6_k", 14, 256, 210, "s6", _q6_k, k_scales=_q6_k_scales),
        Kind("f32", 0, 1, 4, "", float_dtype=torch.float32),
        Kind("f16", 1, 1, 2, "", float_dtype=torch.float16),
        Kind("bf16", 30, 1, 2, "", float_dtype=torch.bfloat16),
    )
}
QUANTIZED_KINDS = tuple(k for k, v in KINDS.items() if v.quantized)
_BY_TYPE = {k.ggml_type: k for k in KINDS.values()}


def by_ggml_type(ggml_type: int) -> Kind | None:
    return _BY_TYPE.get(int(ggml_type))


def check_supported(tensors: Iterable[tuple[str, int]]) -> None:
    """Refuses (QuantError) the first (name, GGML type) whose kind is not in the table, naming those that are."""
    for name, t in tensors:
        if by_ggml_type(t) is None:
            import gguf

            try:
                label = gguf.GGMLQuantizationType(int(t)).name
            except ValueError:
                label = f"type {int(t)}"
            raise QuantError(
                f"tensor {name} is {label}, which this runtime does not read; supported kinds: "
                + ", ".join(k.upper() for k in KINDS)
            )


@dataclass
class BlockTensor:
    """An (n, k) weight as its GGUF blocks: ``data`` uint8 (n, row_bytes), row i the blocks of weight row i."""

    kind: str
    n: int
    k: int
    data: torch.Tensor

    def __post_init__(self) -> None:
        spec = KINDS.get(self.kind)
        if spec is None or not spec.quantized:
            raise QuantError(f"{self.kind!r} is not a quantized kind ({', '.join(QUANTIZED_KINDS)})")
        want = (self.n, spec.row_bytes(self.k))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise QuantError(f"{self.kind} {self.n}x{self.k} needs uint8 data {want}, got {tuple(self.data.shape)}")

    @property
    def spec(self) -> Kind:
        return KINDS[self.kind]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @staticmethod
    def from_gguf(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> BlockTensor:
        """The reader's uint8 data of a tensor of PyTorch ``shape`` (GGUF's dims reversed), copied."""
        if kind not in QUANTIZED_KINDS:
            raise QuantError(f"{kind!r} is not a quantized kind ({', '.join(QUANTIZED_KINDS)})")
        if len(shape) != 2:
            raise QuantError(f"{kind} tensor of shape {tuple(shape)}: quantized weights are 2-d")
        n, k = int(shape[0]), int(shape[1])
        flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        rb = KINDS[kind].row_bytes(k)
        if flat.size != n * rb:
            raise QuantError(f"{kind} data of {flat.size} bytes does not hold a {n}x{k} tensor")
        return BlockTensor(kind, n, k, torch.from_numpy(flat.reshape(n, rb).copy()))

    @staticmethod
    def from_group_quant(gq: GroupQuant) -> BlockTensor:
        """A Q4_0, Q4_1 or Q8_0 GroupQuant (a format-2 store's NAME.q/.d/.m) as its GGUF blocks."""
        if gq.kind not in ("q4_0", "q4_1", "q8_0"):
            raise QuantError(f"only GGUF Q4_0/Q4_1/Q8_0 GroupQuants have blocks, not {gq.kind or 'one made here'}")
        n, k = gq.shape
        parts: list[np.ndarray] = [gq.d.to(torch.float16).numpy().reshape(n, -1, 1).view(np.uint8)]
        if gq.kind == "q4_1":
            parts.append(gq.m.to(torch.float16).numpy().reshape(n, -1, 1).view(np.uint8))
        q = gq.q.numpy().reshape(n, -1, 32)
        if gq.bits == 8:
            parts.append(q.view(np.uint8))
        else:
            parts.append(q[..., :16] | (q[..., 16:] << 4))
        blocks = np.concatenate(parts, axis=-1).reshape(n, -1)
        return BlockTensor(gq.kind, n, k, torch.from_numpy(np.ascontiguousarray(blocks)))

    def decompose(self) -> Decomposed:
        """Values (n, k) int16, scales and offsets (n, k / 16) float32 (offsets None for the symmetric kinds)."""
        spec = self.spec
        assert spec.decompose is not None
        q, s, o = spec.decompose(self.data.numpy().reshape(-1, spec.block_bytes))
        n = self.n
        return q.reshape(n, self.k), s.reshape(n, -1), None if o is None else o.reshape(n, -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight, float32 as ``gguf.quants.dequantize`` gives it, then cast to ``dtype``."""
        q, s, o = self.decompose()
        w = q.astype(np.float32).reshape(self.n, -1, 16) * s[..., None]
        if o is not None:
            w += o[..., None]
        out = torch.from_numpy(w.reshape(self.n, self.k))
        return out if dtype == torch.float32 else out.to(dtype)

    def permute_rows(self, index: torch.Tensor | np.ndarray) -> BlockTensor:
        """Rows reordered: row i of the result is row ``index[i]`` (whole rows: blocks run along a row)."""
        return BlockTensor(self.kind, self.n, self.k, self.data[torch.as_tensor(index, dtype=torch.long)].contiguous())

    def group_quant(self) -> GroupQuant | None:
        """The weight as a GroupQuant for torch's int4/int8 layers and the 4/8-bit kernels (Q4_0, Q4_1, Q8_0 as
        they are, read from the bytes without widening: the largest tables are Q8_0), else None."""
        if self.kind not in ("q4_0", "q4_1", "q8_0"):
            return None
        n, k = self.shape
        b = self.data.numpy().reshape(n, k // 32, -1)
        d = torch.from_numpy(_f16(b[..., 0:2]).reshape(n, -1))
        if self.kind == "q8_0":
            q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k))
            return GroupQuant(q, d, torch.zeros_like(d), 8, 32, "q8_0")
        at = 4 if self.kind == "q4_1" else 2
        q = torch.from_numpy(np.concatenate([b[..., at:] & 0x0F, b[..., at:] >> 4], axis=-1).reshape(n, k))
        m = torch.from_numpy(_f16(b[..., 2:4]).reshape(n, -1)) if self.kind == "q4_1" else d * -8.0
        return GroupQuant(q, d, m, 4, 32, self.kind)


def kind_summary(kinds: Iterable[str]) -> str:
    """e.g. "210 q4_1, 1 q8_0" in the table's order, or "none"."""
    kinds = list(kinds)
    counts = {k: kinds.count(k) for k in KINDS}
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "none"
