"""Weight-only quantization: grouped 4- and 8-bit weights (:class:`GroupQuant`), from GGUF blocks as they
are (``quant_kinds.BlockTensor.group_quant``: Q4_0, Q4_1, Q8_0) or quantized here from float weights
(:func:`quantize_int4`, :func:`quantize_int8`), and the linear layers that run them on torch's CPU weight-only kernels
(:class:`Int4Linear`, :class:`Int8Linear`). Activations stay bfloat16; norms, softmax and logits are the
model's business and stay float32.

Bytes per weight of a projection in each weight format (``models/weights.py`` serves them):

    | format | bytes/weight               | runs on                                                        |
    |--------|----------------------------|----------------------------------------------------------------|
    | fp32   | 4                          | ``F.linear`` (MKL / oneDNN), any device                        |
    | bf16   | 2                          | ``F.linear`` (oneDNN, AMX where the CPU has it), any device     |
    | int8   | 1 + 2/K (bf16 scale a row) | ``torch._weight_int8pack_mm`` on CPU (``cpu_kernels`` on AVX2  |
    |        |                            | without AVX-512); bf16 ``F.linear`` on CUDA                    |
    | int4   | 0.5 + 4/32 (bf16 scale and | ``torch._weight_int4pack_mm_for_cpu`` on CPU; bf16 ``F.linear`` |
    |        | zero a group of 32)        | on CUDA                                                        |

Torch's CPU kernels want bfloat16 activations: with float32 ones they are many times slower (docs/performance.md),
so the layers refuse them. All the CPU kernels are batch-invariant (row i of an M-row call equals a 1-row call bit
for bit), which the engine's speculative verification relies on; tests/models/test_quant.py and test_cpu_kernels.py
check it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels

_INT4_N_MULTIPLE = 16  # the CPU int4 packer needs N divisible by 16; other row counts are padded


class QuantError(ValueError):
    """Blocks or a weight that cannot be (de)quantized as asked: unknown type, wrong size, bad shape."""


@dataclass
class GroupQuant:
    """A quantized (N, K) weight: ``w[n, k] = d[n, k // group] * q[n, k] + m[n, k // group]``.

    ``q`` is uint8 in 0..15 for ``bits=4`` and int8 for ``bits=8``; ``d`` and ``m`` are float32 (N, K // group),
    ``m`` zeros for symmetric formats. ``kind`` names the GGUF block type the values came from ("q4_0",
    "q4_1", "q8_0"; Q4_0's ``w = d * (q - 8)`` is ``m = -8 d``), or is "" for weights quantized here.
    """

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    bits: int
    group: int
    kind: str = ""

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise QuantError(f"bits must be 4 or 8, not {self.bits}")
        want = torch.uint8 if self.bits == 4 else torch.int8
        if self.q.dtype != want or self.q.dim() != 2:
            raise QuantError(f"{self.bits}-bit q must be a 2-d {want} tensor, got {self.q.dtype} {tuple(self.q.shape)}")
        n, k = self.q.shape
        if self.group <= 0 or k % self.group:
            raise QuantError(f"group {self.group} does not divide the row length {k}")
        groups = (n, k // self.group)
        for name, t in (("d", self.d), ("m", self.m)):
            if t.dtype != torch.float32 or tuple(t.shape) != groups:
                raise QuantError(f"{name} must be float32 of shape {groups}, got {t.dtype} {tuple(t.shape)}")
        if self.kind == "q4_0" and not torch.equal(self.m, self.d * -8.0):
            raise QuantError("q4_0 weights need m = -8 d")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    @property
    def symmetric(self) -> bool:
        return not bool(self.m.any())

    @property
    def nbytes(self) -> int:
        """Bytes of the compact form the store keeps: q at ``bits`` a value, d and m as float16."""
        n, k = self.shape
        return n * k * self.bits // 8 + 2 * 2 * self.d.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight, computed in float32 as ``gguf.quants.dequantize`` computes it (Q4_1 and weights
        quantized here ``d * q + m``, Q8_0 ``d * q``, Q4_0 ``d * (q - 8)``), so that float32 results equal gguf's
        bit for bit, then cast to ``dtype``."""
        n, k = self.shape
        w = self.q.to(torch.float32)
        if self.kind == "q4_0":
            w.sub_(8)  # m is -8 d (checked at construction); this order gives gguf's signed zeros
        w.view(n, -1, self.group).mul_(self.d.unsqueeze(-1))
        if self.kind != "q4_0" and not self.symmetric:
            w.view(n, -1, self.group).add_(self.m.unsqueeze(-1))
        return w if dtype == torch.float32 else w.to(dtype)

    @staticmethod
    def cat(parts: list[GroupQuant]) -> GroupQuant:
        """Stack weights along rows (fused projections such as qkv); all parts share bits and group."""
        if not parts:
            raise QuantError("nothing to concatenate")
        first = parts[0]
        for p in parts[1:]:
            if (p.bits, p.group, p.shape[1]) != (first.bits, first.group, first.shape[1]):
                raise QuantError(
                    f"cannot fuse {p.bits}-bit group {p.group} K={p.shape[1]} with "
                    f"{first.bits}-bit group {first.group} K={first.shape[1]}"
                )
        kinds = {p.kind for p in parts}
        return GroupQuant(
            q=torch.cat([p.q for p in parts]),
            d=torch.cat([p.d for p in parts]),
            m=torch.cat([p.m for p in parts]),
            bits=first.bits,
            group=first.group,
            kind=first.kind if len(kinds) == 1 else "",
        )

    def permute_rows(self, index: torch.Tensor | np.ndarray) -> GroupQuant:
        """Rows reordered: row i of the result is row ``index[i]`` of this weight."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return GroupQuant(self.q[idx], self.d[idx], self.m[idx], self.bits, self.group, self.kind)

    def packed_q(self) -> torch.Tensor:
        """q as stored: 4-bit values two a byte, low nibble first ((N, K // 2) uint8); 8-bit as is."""
        if self.bits == 8:
            return self.q
        pairs = self.q.view(self.shape[0], -1, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4)

    @classmethod
    def from_packed(
        cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, group: int, kind: str = ""
    ) -> GroupQuant:
        """Inverse of :meth:`packed_q`; ``d`` and ``m`` may be float16 (as stored) and become float32."""
        if bits == 4:
            if q.dtype != torch.uint8:
                raise QuantError(f"packed 4-bit q must be uint8, got {q.dtype}")
            q = torch.stack([q & 0x0F, q >> 4], dim=-1).view(q.shape[0], -1)
        return cls(q, d.to(torch.float32), m.to(torch.float32), bits, group, kind)


def quantize_int4(w: torch.Tensor, group: int = 32) -> GroupQuant:
    """Asymmetric 4-bit quantization per group of ``group`` weights along K, as GGUF's Q4_1 does it:
    ``d = (max - min) / 15``, ``m = min``, ``q = round((w - m) / d)`` (q = 0 where a group is constant)."""
    if w.dim() != 2:
        raise QuantError(f"quantize a 2-d weight, not shape {tuple(w.shape)}")
    n, k = w.shape
    if k % group:
        raise QuantError(f"group {group} does not divide the row length {k}")
    g = w.detach().to(torch.float32).reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = ((g - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.uint8)
    return GroupQuant(q.reshape(n, k), d, lo, bits=4, group=group)


def quantize_int8(w: torch.Tensor) -> GroupQuant:
    """Symmetric 8-bit quantization per output channel (group = K): ``q = round(w / d)`` in -127..127.
    ``d`` is a bfloat16 value (the int8 kernel's scale dtype), rounded up from ``absmax / 127`` so no value
    clips: the kernel then applies exactly this ``d``, and :meth:`GroupQuant.dequantize` is what it computes."""
    if w.dim() != 2:
        raise QuantError(f"quantize a 2-d weight, not shape {tuple(w.shape)}")
    w = w.detach().to(torch.float32)
    n, k = w.shape
    d = (w.abs().amax(-1, keepdim=True) / 127).clamp_(min=torch.finfo(torch.bfloat16).tiny)
    d_bf = d.to(torch.bfloat16)
    d = torch.where(d_bf.to(torch.float32) < d, torch.nextafter(d_bf, torch.full_like(d_bf, math.inf)), d_bf)
    d = d.to(torch.float32)
    q = (w / d).round_().clamp_(-127, 127).to(torch.int8)
    return GroupQuant(q, d, torch.zeros_like(d), bits=8, group=k)


class _QuantLinear(nn.Module):
    """``y = x @ w.T (+ bias)`` for a GroupQuant of ``bits`` bits, bfloat16 in and out: on CPU a subclass's
    packed buffers (``_pack``, ``_cpu_buffers``) and kernel (``_mm``); on any other device the dequantized
    weight in bfloat16 and ``F.linear``."""

    bits: int
    input_dtype = torch.bfloat16  # what forward takes
    weight: torch.Tensor  # other devices: the dequantized bf16 weight
    bias: torch.Tensor | None

    def __init__(self, gq: GroupQuant, bias: torch.Tensor | None = None, device: str | torch.device = "cpu"):
        super().__init__()
        if gq.bits != self.bits:
            raise QuantError(f"{type(self).__name__} needs {self.bits}-bit weights, got {gq.bits}-bit")
        self.out_features, self.in_features = gq.shape
        device = torch.device(device)
        self.on_cpu = device.type == "cpu"
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(device=device, dtype=torch.bfloat16), persistent=False
        )
        if self.on_cpu:
            self._pack(gq)
        else:
            self.register_buffer("weight", gq.dequantize(torch.bfloat16).to(device), persistent=False)

    def _pack(self, gq: GroupQuant) -> None:
        raise NotImplementedError

    def _cpu_buffers(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) bf16 → (M, N) bf16 on the packed weight."""
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:
        bufs = self._cpu_buffers() if self.on_cpu else (self.weight,)
        extra = () if self.bias is None else (self.bias,)
        return sum(t.numel() * t.element_size() for t in (*bufs, *extra))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"quantized linear layers take bfloat16 activations, got {x.dtype}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer {self.in_features}")
        if not self.on_cpu:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        y = self._mm(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4Linear(_QuantLinear):
    """``y = x @ w.T (+ bias)`` for a 4-bit GroupQuant, bfloat16 in and out.

    On CPU the weight is packed once for ``torch._weight_int4pack_mm_for_cpu``, which computes
    ``w = scale * (q - 8) + zero`` a group: scale = d and zero = m + 8 d, both rounded to bfloat16 (the only
    difference from :meth:`GroupQuant.dequantize`; on the default model's Q4_1 projections 0.20% relative
    Frobenius error, at most 0.34% of a tensor's largest weight). Row counts
    that are not a multiple of 16 are padded with zero rows. On any other device (CUDA) the layer keeps the
    dequantized weight in bfloat16 and calls ``F.linear``: correct, but with bf16's memory cost.
    """

    bits = 4
    packed: torch.Tensor  # CPU: the int4pack layout of q (rows padded to a multiple of 16)
    scales_and_zeros: torch.Tensor  # CPU: (K // group, N, 2) bf16

    def __init__(self, gq: GroupQuant, bias: torch.Tensor | None = None, device: str | torch.device = "cpu"):
        self.group = gq.group
        super().__init__(gq, bias, device)

    def _pack(self, gq: GroupQuant) -> None:
        pad = -self.out_features % _INT4_N_MULTIPLE
        q, d, zero = gq.q.to(torch.int32), gq.d, gq.m + 8 * gq.d
        if pad:
            q = F.pad(q, (0, 0, 0, pad), value=8)
            d, zero = F.pad(d, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        pack = torch._convert_weight_to_int4pack_for_cpu  # pyright: ignore[reportPrivateImportUsage]
        self.register_buffer("packed", pack(q.contiguous(), 1), persistent=False)
        sz = torch.stack([d, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.register_buffer("scales_and_zeros", sz, persistent=False)

    def _cpu_buffers(self) -> tuple[torch.Tensor, ...]:
        return self.packed, self.scales_and_zeros

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        mm = torch._weight_int4pack_mm_for_cpu  # pyright: ignore[reportPrivateImportUsage]
        y = mm(x, self.packed, self.group, self.scales_and_zeros)
        return y[:, : self.out_features] if y.shape[-1] != self.out_features else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group}"


class Int8Linear(_QuantLinear):
    """``y = x @ w.T (+ bias)`` for an 8-bit GroupQuant, bfloat16 in and out, on ``torch._weight_int8pack_mm``.

    The kernel has one scale per output channel. On a CPU with AVX2 but no AVX-512 the layer runs
    ``cpu_kernels``' kernel instead, which reads the weight once for every 4 rows where torch's reads it once a
    row, and prefetches it (same values, same float32 math in its own order; batch-invariant as well).

    A GroupQuant with smaller groups (GGUF Q8_0: 32) is dequantized and requantized per channel with
    :func:`quantize_int8`, which costs accuracy: on the default model's tied lm head (49152x576 Q8_0) the
    requantized weight differs from the Q8_0 one by 1.18% (relative Frobenius norm), and over 1,024 tokens of
    docs/architecture.md its logits differ from the float32 Q8_0 head's by 0.79% (relative L2), with the same top-1
    token at 96.8% of positions (a bf16 copy of the Q8_0 weight: 0.31% and 98.3%). On any other device (CUDA) the
    layer keeps the dequantized weight in bfloat16 and calls ``F.linear``.
    """

    bits = 8
    q: torch.Tensor  # CPU: (N, K) int8
    scales: torch.Tensor  # CPU: (N,) bf16

    def _pack(self, gq: GroupQuant) -> None:
        if gq.group != self.in_features or not gq.symmetric:
            gq = quantize_int8(gq.dequantize())
        self.register_buffer("q", gq.q.contiguous(), persistent=False)
        self.register_buffer("scales", gq.d[:, 0].to(torch.bfloat16).contiguous(), persistent=False)
        # a bool, not the library: a module holding a ctypes handle could not be deep-copied
        self.kernel = self.in_features % cpu_kernels.K_MULTIPLE == 0 and cpu_kernels.available()

    def _cpu_buffers(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.scales

    def rows(self, ids: torch.Tensor) -> Int8Linear:
        """A CPU layer computing only the output rows ``ids``, with this layer's int8 values and scales as they
        are (a drafter's slice of the lm head: its logits are the served head's, bit for bit). No bias."""
        if not self.on_cpu:
            raise QuantError("rows() needs the CPU layer's int8 buffers")
        d = self.scales.index_select(0, ids).float().unsqueeze(-1)  # bf16 values: _pack keeps them exactly
        gq = GroupQuant(self.q.index_select(0, ids), d, torch.zeros_like(d), bits=8, group=self.in_features)
        return Int8Linear(gq)  # same K, same process: the head's kernel, so the head's bits

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return cpu_kernels.q8_mm(x, self.q, self.scales)
        mm = torch._weight_int8pack_mm  # pyright: ignore[reportPrivateImportUsage]
        return mm(x, self.q, self.scales)
