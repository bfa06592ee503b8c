"""The attention arithmetic of the torch path's batch-invariant forms (models/llama.py's ``Attention`` picks
one): bf16's :func:`attend_invariant` and float32's :func:`attend_fp32_blocks` over :class:`Fp32KeyBlocks`,
each giving a query row the same bits whatever the other rows of its call, its chunking or its padding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# A batch-invariant model attends in slices of at most this many query rows per sequence (any verify window is
# one slice), so that a row's bits do not depend on how its prompt was chunked: a prefix-cache hit recomputes a
# prompt's tail in a short window that a first run computed inside a long chunk. Slicing makes a prefill a little
# slower than one SDPA call per chunk (docs/performance.md, "Invariant slices in prefill").
INVARIANT_MAX_ROWS = 64
# The float32 form (CPUs without bf16 units, :func:`attend_invariant_fp32`): every matmul has one shape, query
# rows padded to FP32_ROWS and keys cut into blocks of FP32_KEYS, because MKL picks its sgemm kernel (and so
# its rounding) by shape
FP32_ROWS = 4
FP32_KEYS = 64
INVARIANT_KEYS = 128
# softmax as 2^(x log2 e): the scores are scaled by log2 e with the head's scale, free, and exp2 costs the same
# for every input, where MKL's exp (torch's CPU exp) takes a slow path on -inf and on results below float32's
# normal range, which the padding rows' scores are (docs/performance.md, "Float32 attention")
LOG2_E = 1.4426950408889634


def attention_bias(mask: torch.Tensor) -> torch.Tensor:
    """:func:`attend_invariant`'s additive mask, (B, 1, Q, K) float32: 0 where a query may attend a key, -inf
    where not (the same for every layer of a pass: computed once)."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))


def attend_invariant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention whose result for a query row does not depend on the other rows of the call nor on how many
    masked keys pad its sequence: q (B, h, Q, D), k/v (B, kvh, K, D), mask (B, 1, Q, K) → (B, h, Q, D).
    Longer chunks go in slices of INVARIANT_MAX_ROWS rows, so a prompt's rows get the same bits however it was
    chunked or how much of it a prefix-cache hit skipped. ``bias``: :func:`attention_bias` of ``mask``, when the
    caller keeps it across layers."""
    if bias is None:
        bias = attention_bias(mask)
    step = INVARIANT_MAX_ROWS
    parts = [
        _attend_invariant_slice(q[:, :, i : i + step], k, v, bias[:, :, i : i + step], scale)
        for i in range(0, q.shape[2], step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _attend_invariant_slice(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """One slice of :func:`attend_invariant` (at most INVARIANT_MAX_ROWS query rows); ``bias`` (B, 1, Q, K) is 0
    where a query may attend a key and -inf where not.

    A verify window of 1 + k rows must give each row the bits a 1-row decode pass gives it, or greedy
    speculation could part from plain decoding on a near tie. In bfloat16, SDPA's result moves with the
    padded key length. The scores are a matmul over D (one reduction length whatever the call); max and exp2 are
    exact elementwise ops. The weighted sum of V together with its normaliser (a column of ones beside V) runs over
    blocks of INVARIANT_KEYS keys, one matmul shape, summed in order (on a CPU in float64, rounded once to float32:
    :func:`_sum_blocks_in_order`), so the blocks past a sequence's keys add exact zeros: one matmul over all the
    padded keys reduced in another order once they passed the kernel's own block on a CPU with AMX (a row's bits
    then moved with the longest sequence of its batch).
    Query heads that share a key head are stacked as extra query rows of that head (grouped-query attention).

    At a few rows the cost is the number of ops, not their arithmetic (each a few microseconds on tensors of a
    few hundred keys), so scale and mask are one add (``bias + scale * qk``: a fused multiply-add whose addend
    is 0 or -inf rounds as the product alone), exp runs in place, and the padded weights and [V | 1] are
    written once into their blocked buffers: the same bits in fewer ops (docs/performance.md, "bf16
    batch-invariant attention")."""
    b, h, nq, d = q.shape
    kvh, n_keys = k.shape[1], k.shape[2]
    g = h // kvh
    qs = q.reshape(b, kvh, g * nq, d)  # head i uses key head i // g: heads of a group are adjacent
    # keys made contiguous, then viewed transposed: the batched matmul then folds (B, kvh) into one batch of
    # plain transposed matrices whatever B is. On the gathered strided view it copied them into another
    # layout when B > 1 and not when B = 1, and on CPUs without bf16 units (AVX2) the two paths round
    # differently, so a row's scores changed with the batch it was in (and the copy cost more than the matmul)
    kt = k.contiguous().transpose(-1, -2)
    qk = torch.matmul(qs, kt).view(b, kvh, g, nq, n_keys)
    scores = torch.add(bias.unsqueeze(2), qk, alpha=scale * LOG2_E).view(b, kvh, g * nq, n_keys)  # float32
    scores.sub_(scores.amax(-1, keepdim=True)).exp2_()
    block = INVARIANT_KEYS
    kpad = -n_keys % block
    nb = (n_keys + kpad) // block
    weights = scores.new_empty(b, kvh, g * nq, n_keys + kpad, dtype=q.dtype)
    weights[..., :n_keys].copy_(scores)
    weights[..., n_keys:].zero_()
    vo = v.new_empty(b, kvh, n_keys + kpad, d + 1)  # [V | 1], zero past the keys
    vo[:, :, :n_keys, :d].copy_(v)
    vo[:, :, :n_keys, d] = 1
    vo[:, :, n_keys:].zero_()
    wb = weights.view(b, kvh, g * nq, nb, block).transpose(2, 3)
    parts = torch.matmul(wb, vo.view(b, kvh, nb, block, d + 1)).float()
    summed = _sum_blocks_in_order(parts)
    out = summed[..., :d] / summed[..., d:]
    return out.to(q.dtype).reshape(b, h, nq, d)


def _sum_blocks_in_order(parts: torch.Tensor) -> torch.Tensor:
    """(batch, heads, blocks, ...) float32 → (batch, heads, ...): the key blocks' partial sums added one after
    another, an order that does not depend on how many blocks there are (``sum`` over the dim would reduce in its own
    order). torch's CPU cumsum is that sequential scan, accumulating float32 in float64, so its last prefix is
    the in-order sum rounded once, and the zero blocks past a sequence's keys leave it as it is: one op where
    adding block by block took one per block."""
    if parts.device.type != "cpu":
        summed = parts[:, :, 0]
        for j in range(1, parts.shape[2]):
            summed = summed + parts[:, :, j]
        return summed
    return parts.cumsum(2)[:, :, -1]


def fp32_padded_keys(n_keys: int) -> int:
    """The float32 form's key count for ``n_keys`` keys: whole blocks of FP32_KEYS (its mask and its K and V
    buffers must agree on it)."""
    return -(-n_keys // FP32_KEYS) * FP32_KEYS


def fp32_attention_bias(mask: torch.Tensor, heads_per_kv: int) -> list[torch.Tensor]:
    """:func:`attend_invariant_fp32`'s additive mask, one (B, 1, blocks, heads_per_kv * FP32_ROWS, FP32_KEYS)
    float32 tensor per slice of FP32_ROWS query rows: 0 where a row may attend a key, -inf where not or past the
    keys. A padding row attends one key, so its (discarded) softmax stays finite. The same for every layer of a
    pass: computed once."""
    b, _, nq, n_keys = mask.shape
    rows, block = FP32_ROWS, FP32_KEYS
    padded = fp32_padded_keys(n_keys)
    kpad, nb = padded - n_keys, padded // block
    slices = []
    for i in range(0, nq, rows):
        n = min(rows, nq - i)
        m = F.pad(mask[:, :, i : i + n], (0, kpad, 0, rows - n), value=False)
        m[:, :, n:, 0] = True
        m = m.view(b, 1, rows, nb, block).transpose(2, 3).repeat(1, 1, 1, heads_per_kv, 1)  # rows ordered as q's
        slices.append(torch.zeros(m.shape, dtype=torch.float32, device=mask.device).masked_fill_(~m, float("-inf")))
    return slices


class Fp32KeyBlocks:
    """A pass's padded float32 K and [V | 1] for one attention group (:func:`attend_fp32_blocks`' input), its
    buffers made once and refilled by every layer: each sequence's pages, padded to a multiple of FP32_KEYS keys
    by repeating page 0 (masked, so only its values' finiteness matters), gathered head-major from the pool and
    converted in one contiguous copy; the column of ones is written once. A fresh float32 buffer a layer took
    about twice the time of the copy into a kept one (profiled, 1 row at 600 keys, 2 threads)."""

    def __init__(self, key_pages: torch.Tensor, k_pages: torch.Tensor):
        b, p = key_pages.shape
        kvh, _, ps, d = k_pages.shape
        self.n_keys = fp32_padded_keys(p * ps)
        extra = -(-self.n_keys // ps) - p  # a page size that does not divide FP32_KEYS overshoots: cut below
        self.pages = (F.pad(key_pages, (0, extra)) if extra else key_pages).flatten()
        self.kg = torch.empty(kvh, self.pages.numel(), ps, d, dtype=k_pages.dtype, device=k_pages.device)
        self.vg = torch.empty_like(self.kg)
        self.kb = torch.empty(kvh, b, self.n_keys, d, dtype=torch.float32, device=k_pages.device)
        self.vb = torch.empty(kvh, b, self.n_keys, d + 1, dtype=torch.float32, device=k_pages.device)
        self.vb[..., d] = 1

    def gather(self, k_pages: torch.Tensor, v_pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (kvh, B, K, D) K and (kvh, B, K, D + 1) [V | 1], float32, from its (kvh, pages, ps, D)
        pool pages."""
        kvh, b, n, d = self.kb.shape
        torch.index_select(k_pages, 1, self.pages, out=self.kg)
        torch.index_select(v_pages, 1, self.pages, out=self.vg)
        self.kb.copy_(self.kg.view(kvh, b, -1, d)[:, :, :n])
        self.vb[..., :d].copy_(self.vg.view(kvh, b, -1, d)[:, :, :n])
        return self.kb, self.vb


def attend_invariant_fp32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    bias: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`attend_invariant`'s contract in float32, for CPUs without bf16 units: q (B, h, Q, D), k/v (B, kvh,
    K, D), mask (B, 1, Q, K) → (B, h, Q, D). K and [V | 1] are laid out in :func:`attend_fp32_blocks`'s padded
    buffers here; a layer gathers its pages straight into them instead. ``bias``: :func:`fp32_attention_bias`
    of ``mask``, when the caller keeps it across layers."""
    b, kvh, n_keys, d = k.shape
    padded = fp32_padded_keys(n_keys)
    kb = torch.zeros(kvh, b, padded, d, dtype=torch.float32, device=k.device)
    kb[:, :, :n_keys].copy_(k.transpose(0, 1))
    vb = torch.zeros(kvh, b, padded, d + 1, dtype=torch.float32, device=v.device)
    vb[:, :, :n_keys, :d].copy_(v.transpose(0, 1))
    vb[..., d] = 1
    if bias is None:
        bias = fp32_attention_bias(mask, q.shape[1] // kvh)
    return attend_fp32_blocks(q, kb, vb, bias, scale)


def attend_fp32_blocks(
    q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, bias: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """The float32 form's arithmetic: q (B, h, Q, D) any dtype; kb (kvh, B, K, D) and vb (kvh, B, K, D + 1), [V | 1],
    float32, contiguous, K a multiple of FP32_KEYS (keys past a sequence's are masked by ``bias``, any finite
    values); ``bias`` :func:`fp32_attention_bias` → (B, h, Q, D) in q's dtype. Without bf16 units a bf16 matmul
    is emulated, and the attention's two matmuls took a large share of a few-row int4 pass.

    Query rows go in slices of FP32_ROWS, padded; keys and values in blocks of FP32_KEYS: every sgemm has one
    shape whatever the window, the batch or the padding, and MKL computes a given shape in a fixed order. The
    batch runs key head first, so each head's keys are one run of the pool's head-major pages (no copy into
    another layout, which on AVX2 rounds differently). The scores of a block are (rows × D) @ (D × block),
    scaled and masked in one add (``bias + scale * qk``, ``bias`` 0 or -inf: the product's rounding alone);
    the softmax's max runs over all blocks (max is exact) and takes exp2 (LOG2_E); the weighted sums of V and
    their normaliser (the column of ones) are summed block by block in order (:func:`_sum_blocks_in_order`), so
    the blocks past a sequence's keys add exact zeros.

    At a few rows the cost is the number of ops, hence K and [V | 1] written once, the mask kept for the pass,
    exp2 and one cumsum (docs/performance.md, "Float32 attention")."""
    b, h, nq, d = q.shape
    kvh = kb.shape[0]
    g, rows, block = h // kvh, FP32_ROWS, FP32_KEYS
    nb = kb.shape[2] // block
    kt = kb.view(kvh, b, nb, block, d).transpose(-1, -2)
    vb = vb.view(kvh, b, nb, block, d + 1)
    outs = []
    for s, i in enumerate(range(0, nq, rows)):
        n = min(rows, nq - i)
        qs = F.pad(q[:, :, i : i + n].float(), (0, 0, 0, rows - n)).reshape(b, kvh, 1, g * rows, d).transpose(0, 1)
        # (kvh, B, blocks, g*rows, block)
        scores = torch.add(bias[s].transpose(0, 1), torch.matmul(qs, kt), alpha=scale * LOG2_E)
        peak = scores.amax(-1, keepdim=True).amax(2, keepdim=True)
        parts = torch.matmul(scores.sub_(peak).exp2_(), vb)  # (kvh, B, blocks, g*rows, D + 1)
        summed = _sum_blocks_in_order(parts)
        out = summed[..., :d] / summed[..., d:]
        outs.append(out.view(kvh, b, g, rows, d)[:, :, :, :n])
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    return out.transpose(0, 1).reshape(b, h, nq, d).to(q.dtype)
