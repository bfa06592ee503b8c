"""A linear layer on the native integer-dot kernel (``kernels/native/qmatmul.h``): the weight kept as GGUF-style
blocks of 32 (4-bit Q4_0/Q4_1 values, or 8-bit Q8_0: kinds WQ4, WQ8) or as any kind of the table in
``quant_kinds`` (kind WX: each group of 8 outputs in its own sub-kind, GGUF's values and scales as they are)
repacked at load into the kernel's x8 layout, and the activations quantized to 8 bits per block of 32 inside the
call. Float32 in, float32 out.

:class:`PackedWeight` is the weight itself, also what the native decoder step reads; :class:`PackedLinear` the
module around it (the lm head, a drafter's projections). A tied embedding table is one of these too: its rows
come back dequantized (:meth:`PackedWeight.rows`), so the table is kept once.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import native_lib
from .quant import GroupQuant, QuantError
from .quant_kinds import BlockTensor, KScales

Q4, Q8, WX = 0, 1, 2  # the kernel's weight kinds
BLOCK = 32
XSUB = {"a4": 0, "s6": 1, "s16": 2, "a5": 3}  # WX's sub-kinds (qmatmul.h): the table's ``native`` names
XD, XDM, XK = 0, 1, 2  # WX's scale modes (qmatmul.h)
_X_CHUNK = 4096  # rows repacked at a time: the int16 values of a large table are never all in memory


def _lib() -> ctypes.CDLL:
    lib = native_lib.library()
    if lib is None:
        raise QuantError(f"the native kernels are not available here ({native_lib.unavailable_reason()})")
    return lib


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0 of a float (N, K) weight, K a multiple of 32: int8 values and float16 scales (N, K / 32),
    ``d = max|w| / 127`` a block and ``q = round(w / d)`` (as llama.cpp's ``quantize_row_q8_0``)."""
    n, k = w.shape
    if k % BLOCK:
        raise QuantError(f"Q8_0 needs rows of whole blocks of {BLOCK}, not {k}")
    g = w.detach().to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    d = g.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = (g * inv.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k), d.to(torch.float16)


@dataclass
class PackedWeight:
    """An (n, k) weight in the kernel's x8 layout: ``data`` uint8, ``kind`` Q4 or Q8."""

    data: torch.Tensor
    kind: int
    n: int
    k: int

    @staticmethod
    def pack_q4(packed_q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> PackedWeight:
        """From the store's 4-bit form: q (n, k / 2) uint8, two values a byte, low nibble first; d and m
        (n, k / 32) float16 (Q4_0: m = -8 d)."""
        lib = _lib()
        n, k = packed_q.shape[0], packed_q.shape[1] * 2
        _check(n, k, d, m)
        q, d, m = packed_q.contiguous(), d.to(torch.float16).contiguous(), m.to(torch.float16).contiguous()
        out = torch.empty(lib.pie_packed_bytes(Q4, n, k), dtype=torch.uint8)
        lib.pie_pack_q4(_ptr(q), _ptr(d), _ptr(m), n, k, _ptr(out))
        return PackedWeight(out, Q4, n, k)

    @staticmethod
    def pack_q8(q: torch.Tensor, d: torch.Tensor) -> PackedWeight:
        """From Q8_0's values: q (n, k) int8, d (n, k / 32) float16."""
        lib = _lib()
        n, k = q.shape
        _check(n, k, d)
        q, d = q.to(torch.int8).contiguous(), d.to(torch.float16).contiguous()
        out = torch.empty(lib.pie_packed_bytes(Q8, n, k), dtype=torch.uint8)
        lib.pie_pack_q8(_ptr(q), _ptr(d), n, k, _ptr(out))
        return PackedWeight(out, Q8, n, k)

    @staticmethod
    def stacked(n: int, slices: Iterable[PackedWeight]) -> PackedWeight:
        """Slices of one kind and row length stacked along rows into one weight of ``n`` rows, copied into its
        buffer as they come (one slice alive at a time). Every slice but the last must have a multiple of 8 rows:
        the layout keeps each group of 8 rows to itself, so the result is the whole weight packed at once."""
        out: torch.Tensor | None = None
        kind = k = rows = at = 0
        for s in slices:
            if out is None:
                kind, k = s.kind, s.k
                out = torch.empty(_lib().pie_packed_bytes(kind, n, k), dtype=torch.uint8)
            if (s.kind, s.k) != (kind, k) or rows % 8:
                raise QuantError("stacked slices need one kind, one row length and, but for the last, 8-row groups")
            out[at : at + s.nbytes] = s.data
            at, rows = at + s.nbytes, rows + s.n
        if out is None or rows != n or at != out.numel():
            raise QuantError(f"stacked slices hold {rows} rows, not {n}")
        return PackedWeight(out, kind, n, k)

    @staticmethod
    def from_group_quant(gq: GroupQuant) -> PackedWeight:
        """A GroupQuant of 4-bit blocks of 32 as it is; 8-bit blocks of 32 as they are; anything else (8-bit per
        channel) requantized to Q8_0 from its float value."""
        if gq.group == BLOCK and gq.bits == 4:
            return PackedWeight.pack_q4(gq.packed_q(), gq.d, gq.m)
        if gq.group == BLOCK and gq.bits == 8 and gq.symmetric:
            return PackedWeight.pack_q8(gq.q, gq.d)
        return PackedWeight.pack_q8(*quantize_q8_0(gq.dequantize()))

    @staticmethod
    def from_float(w: torch.Tensor, bits: int) -> PackedWeight:
        """A float weight quantized here: 4-bit as GGUF's Q4_1, 8-bit as Q8_0."""
        if bits == 4:
            from .quant import quantize_int4

            return PackedWeight.from_group_quant(quantize_int4(w, BLOCK))
        return PackedWeight.pack_q8(*quantize_q8_0(w))

    @staticmethod
    def pack_blocks(parts: list[BlockTensor | torch.Tensor]) -> PackedWeight:
        """Parts stacked along output rows, each in its own kind (kind WX): GGUF blocks as they are, a float part
        quantized to Q8_0. Every part but the last needs a multiple of 8 rows (a group of 8 is one kind)."""
        k = parts[0].shape[1]
        if any(p.shape[1] != k for p in parts) or any(p.shape[0] % 8 for p in parts[:-1]):
            raise QuantError("WX parts need one row length and, but for the last, multiples of 8 rows")
        if k % BLOCK:
            raise QuantError(f"the native kernels need rows of whole blocks of {BLOCK}, not {k}")
        chunks = (
            _part_rows(p, r0, min(r0 + _X_CHUNK, p.shape[0])) for p in parts for r0 in range(0, p.shape[0], _X_CHUNK)
        )
        return _pack_parts(chunks, sum(p.shape[0] for p in parts), k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """(m, k) → (m, n) float32. Inside a torch.compile graph the call is the custom op ``pie::native_qmatmul``,
        which the graph keeps as one opaque node (a ctypes call would break the graph)."""
        if torch.compiler.is_compiling():
            return native_qmatmul(x, self.data, self.kind, self.n, self.k)
        return _qmatmul(x, self.data, self.kind, self.n, self.k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(count,) int64 row ids → (count, k) float32, the rows dequantized (an embedding lookup)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.k, dtype=torch.float32)
        if self.kind == WX:
            _lib().pie_dequant_rows_x(_ptr(self.data), self.n, self.k, _ptr(ids), ids.numel(), _ptr(out))
        else:
            _lib().pie_dequant_rows(_ptr(self.data), self.kind, self.n, self.k, _ptr(ids), ids.numel(), _ptr(out))
        return out

    def select(self, ids: torch.Tensor) -> PackedWeight:
        """The rows ``ids`` as a weight of their own: the same values and scales, the same outputs bit for bit."""
        lib = _lib()
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < self.n):
            raise QuantError(f"row ids outside 0..{self.n - 1}")
        if self.kind == WX:
            header = self.data[: 8 * ((self.n + 7) // 8)].view(torch.int64)
            codes = set((header[ids // 8] & 15).tolist()) if ids.numel() else {0}
            if len(codes) != 1:
                raise QuantError("selected rows of a WX weight must share one kind")
            code = codes.pop()
            out = torch.empty(lib.pie_select_bytes_x(code, ids.numel(), self.k), dtype=torch.uint8)
            lib.pie_select_rows_x(_ptr(self.data), code, self.n, self.k, _ptr(ids), ids.numel(), _ptr(out))
            return PackedWeight(out, WX, ids.numel(), self.k)
        out = torch.empty(lib.pie_packed_bytes(self.kind, ids.numel(), self.k), dtype=torch.uint8)
        lib.pie_select_rows(_ptr(self.data), self.kind, self.k, _ptr(ids), ids.numel(), _ptr(out))
        return PackedWeight(out, self.kind, ids.numel(), self.k)


@dataclass
class _Part:
    """Rows of one part as the packer takes them: sub-kind name, values (rows, k) int16, scales and offsets per
    16 (float32; offsets None for the symmetric kinds) and, for a K kind, its scales as stored."""

    sub: str
    q: np.ndarray
    s16: np.ndarray
    o16: np.ndarray | None
    k_scales: KScales | None = None

    @property
    def mode(self) -> int:
        """The group's scale mode (qmatmul.h): XK for a K kind, XDM with stored offsets, else XD."""
        return XK if self.k_scales is not None else XDM if self.o16 is not None else XD


def _pack_parts(parts: Iterable[_Part], n: int, k: int) -> PackedWeight:
    """Parts' rows (all but the last a multiple of 8) as one WX weight: the header, then each part's records."""
    records, codes = [], []
    for part in parts:
        code, recs = _x_records(part)
        records.append(recs)
        codes += [code] * recs.shape[0]
    groups = len(codes)
    gb = np.array([recs.shape[1] for recs in records for _ in range(recs.shape[0])])
    offsets = 8 * groups + np.concatenate([[0], np.cumsum(gb)[:-1]])
    header = ((offsets.astype(np.int64) << 4) | np.array(codes, dtype=np.int64)).view(np.uint8)
    body = [header, *(r.reshape(-1) for r in records)]
    return PackedWeight(torch.from_numpy(np.concatenate(body)), WX, n, k)


def _part_rows(p: BlockTensor | torch.Tensor, r0: int, r1: int) -> _Part:
    """Rows r0..r1-1 of a part."""
    if isinstance(p, BlockTensor):
        sub = BlockTensor(p.kind, r1 - r0, p.k, p.data[r0:r1])
        spec = p.spec
        ks = None if spec.k_scales is None else spec.k_scales(sub.data.numpy().reshape(-1, spec.block_bytes))
        return _Part(spec.native, *sub.decompose(), ks)
    q, d = quantize_q8_0(p[r0:r1])
    return _Part("s16", q.numpy().astype(np.int16), np.repeat(d.float().numpy(), 2, axis=1), None)


def _x_values(name: str, q: np.ndarray, groups: int, nb: int) -> np.ndarray:
    """Values (rows padded to groups * 8; "s6": signed, -32..31) as the records' value bytes (groups, blocks,
    bytes)."""
    if name in ("a4", "a5", "s6"):
        if name == "s6":
            q = q + 32
        v = (q & 15).astype(np.uint8).reshape(groups, 8, nb, 2, 4, 4)
        values = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4).reshape(groups, nb, 128)
        if name == "a5":  # the fifth bits: 4 bytes an output, bit v = value v
            bits = ((q >> 4) & 1).astype(np.uint8).reshape(groups, 8, nb, 32)
            plane = np.packbits(bits, axis=-1, bitorder="little").transpose(0, 2, 1, 3).reshape(groups, nb, 32)
            values = np.concatenate([values, plane], axis=-1)
        if name == "s6":  # the high 2 bits: value 4(4c + i) + t of output o at bits 2i of byte 4o + t of chunk c
            hi = ((q >> 4) & 3).astype(np.uint8).reshape(groups, 8, nb, 2, 4, 4)
            plane = hi[:, :, :, :, 0] | hi[:, :, :, :, 1] << 2 | hi[:, :, :, :, 2] << 4 | hi[:, :, :, :, 3] << 6
            values = np.concatenate([values, plane.transpose(0, 2, 3, 1, 4).reshape(groups, nb, 64)], axis=-1)
        return values
    v = q.astype(np.int8).view(np.uint8).reshape(groups, 8, nb, 8, 4)
    return v.transpose(0, 2, 3, 1, 4).reshape(groups, nb, 256)


def _x_records(part: _Part) -> tuple[int, np.ndarray]:
    """A part's rows as WX groups: (mode << 2 | sub-kind, (groups, bytes a group)), rows padded to a multiple of 8
    with zeros (qmatmul.h's layout; every scale the float32 value of the dequantized weight, exactly)."""
    name, q, s16, mode = part.sub, part.q, part.s16, part.mode
    n, k = q.shape
    groups, nb, pad = (n + 7) // 8, k // BLOCK, -n % 8
    if name in ("a4", "a5") and part.o16 is None:  # Q4_0 / Q5_0: q + 8 / q + 16 with the offset -8 d / -16 d (mode XD)
        q = q + (8 if name == "a4" else 16)
    values = _x_values(name, np.pad(q, ((0, pad), (0, 0))), groups, nb)

    def lanes(a: np.ndarray) -> np.ndarray:  # (rows, one value a block or super-block) -> (groups, blocks, bytes)
        a = np.pad(a, ((0, pad), (0, 0)))
        return np.ascontiguousarray(a.reshape(groups, 8, -1).transpose(0, 2, 1)).view(np.uint8)

    if part.k_scales is None:
        scales = [lanes(s16[:, 0::2].astype(np.float16))]  # exact: each came from a float16
        if part.o16 is not None:
            scales.append(lanes(part.o16[:, 0::2].astype(np.float16)))
        return mode << 2 | XSUB[name], np.concatenate([values, *scales], axis=-1).reshape(groups, -1)
    d01, a0, a1 = part.k_scales  # (rows * nb / 8, 2) float16; (rows * nb / 8, 8) int8 each
    ints = [lanes(a.reshape(n, nb)) for a in (a0, a1)]
    recs = np.concatenate([values, *ints], axis=-1).reshape(groups, nb // 8, -1)
    head = [lanes(d01[:, j].reshape(n, nb // 8)) for j in (0, 1)]  # (groups, supers, 16) each
    return mode << 2 | XSUB[name], np.concatenate([*head, recs], axis=-1).reshape(groups, -1)


def _qmatmul(x: torch.Tensor, data: torch.Tensor, kind: int, n: int, k: int) -> torch.Tensor:
    lib = _lib()
    x = x.to(torch.float32).contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        scratch = torch.empty(lib.pie_qmatmul_scratch(m, k), dtype=torch.uint8)
        lib.pie_qmatmul(_ptr(data), kind, n, k, _ptr(x), m, _ptr(y), _ptr(scratch))
    return y


@torch.library.custom_op("pie::native_qmatmul", mutates_args=())
def native_qmatmul(x: torch.Tensor, data: torch.Tensor, kind: int, n: int, k: int) -> torch.Tensor:
    """(m, k) float activations times a packed (n, k) weight (``data``, ``kind`` Q4 or Q8) → (m, n) float32: the
    integer-dot matmul as an op a compiled graph can hold."""
    return _qmatmul(x, data, kind, n, k)


@native_qmatmul.register_fake
def _(x: torch.Tensor, data: torch.Tensor, kind: int, n: int, k: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


def _check(n: int, k: int, *scales: torch.Tensor) -> None:
    if k % BLOCK:
        raise QuantError(f"the native kernels need rows of whole blocks of {BLOCK}, not {k}")
    for s in scales:
        if tuple(s.shape) != (n, k // BLOCK):
            raise QuantError(f"block scales of shape {tuple(s.shape)} for a {n}x{k} weight")


class PackedLinear(nn.Module):
    """``y = x @ w.T (+ bias)`` on :class:`PackedWeight`, float32 (any float input) → float32."""

    input_dtype = torch.float32
    bias: torch.Tensor | None

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = weight
        self.register_buffer("data", weight.data, persistent=False)  # counted with the module's buffers
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.out_features, self.in_features = weight.n, weight.k

    @property
    def weight_bytes(self) -> int:
        return self.packed.nbytes + (0 if self.bias is None else self.bias.numel() * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer {self.in_features}")
        lead = x.shape[:-1]
        y = self.packed.matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def rows(self, ids: torch.Tensor) -> PackedLinear:
        """The layer computing only the output rows ``ids`` (a drafter's slice of the lm head), bit for bit the
        same outputs. No bias."""
        return PackedLinear(self.packed.select(ids))

    def extra_repr(self) -> str:
        kind = {Q4: "q4", Q8: "q8", WX: "gguf kinds"}[self.packed.kind]
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"
