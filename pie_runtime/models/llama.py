"""The Llama-family decoder (Touvron et al. 2023) with config switches for SmolLM2, Mistral (sliding window),
Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMS norm) and Gemma 3 (the recipe fields of :class:`ModelConfig`:
GeGLU, norms of 1 + w, sandwich norms, scaled embeddings, a rope table and window per layer kind), over a
paged KV cache.

One forward runs a ragged batch: N rows from many sequences, each row with its own position, K/V written
to and read from the shared page pool through the :class:`ForwardContext`. Parameter names equal Hugging
Face's, so a checkpoint's state dict loads as it is.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .context import AttentionGroup, ForwardContext
from .cpu import bf16_is_fast
from .kv_cache import KVCache
from .linear import Linear
from .rope import Rotary, apply_rotary

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
# None: the float32 form on CPUs without bf16 units, else bf16's; tests set it to run either form anywhere
FP32_ATTENTION: bool | None = None
# softmax as 2^(x log2 e): the scores are scaled by log2 e with the head's scale, free, and exp2 costs the same
# for every input, where MKL's exp (torch's CPU exp) takes a slow path on -inf and on results below float32's
# normal range, which the padding rows' scores are (docs/performance.md, "Float32 attention")
LOG2_E = 1.4426950408889634


class RMSNorm(nn.Module):
    """rms_normed(x) * (offset + weight): offset 0 for Llama, 1 for Gemma (whose norms compute in float32)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            w = self.weight.float() + self.offset
            return F.rms_norm(x.float(), (x.shape[-1],), w, self.eps).to(x.dtype)
        if x.dtype == self.weight.dtype:  # torch's kernel accumulates a bf16 input in float32 by itself
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    window: int | None = None  # keys a query sees (None: every earlier one); subclasses without windows keep it

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj: nn.Module = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_weight_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_weight_offset)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.attention_scale
        self.window = cfg.attention_window(layer)  # keys this layer's queries see (None: every earlier one)
        self.qkv_proj: nn.Module | None = None  # q, k and v in one matmul, once prepared for serving
        self.batch_invariant = False  # attend windows with batch-invariant matmuls (attend_invariant)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N, H) normed input → q (N, h, D), k and v (N, kvh, D), q and k rotated."""
        n, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(n, h + 2 * kvh, d)
            if not self.qk_norm:  # one rotation over q's and k's heads together
                qk = apply_rotary(qkv[:, : h + kvh], cos, sin)
                return qk[:, :h], qk[:, h:], qkv[:, h + kvh :]
            q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
        else:
            q = self.q_proj(x).view(n, h, d)
            k = self.k_proj(x).view(n, kvh, d)
            v = self.v_proj(x).view(n, kvh, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, kv: KVCache
    ) -> torch.Tensor:
        """Writes k and v into the cache, attends each row over its sequence's pages → (N, h * D)."""
        n, h, kvh, d = q.shape[0], self.heads, self.kv_heads, self.head_dim
        k_cache, v_cache = kv.layer(self.layer)  # (kvh, slots, D) of its page group's pages
        view = ctx.view(self.layer)  # its page group's slots and its window's attention calls
        k_cache.index_copy_(1, view.write_slots, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, view.write_slots, v.transpose(0, 1).to(v_cache.dtype))
        if ctx.scores is not None:  # the attention readout, only on a pass that reads it
            ctx.scores.add(self.layer, q, k_cache, self.scale)
        ps = kv.page_size
        k_pages = k_cache.view(kvh, -1, ps, d)  # (kvh, pages, ps, D)
        v_pages = v_cache.view(kvh, -1, ps, d)
        fp32 = self.batch_invariant and _fp32_attention(q)
        window = self.window

        out = None if _one_span(view.groups, n) else torch.empty(n, h, d, dtype=q.dtype, device=q.device)
        for g in view.groups:
            b, p = g.key_pages.shape
            if g.row_span is not None:  # the rows in order: a slice, laid out as the gather would lay it out
                first, count = g.row_span
                qg = q[first : first + count].reshape(b, count // b, h, d).transpose(1, 2)  # (B, h, Q, D)
            else:
                qg = q[g.query_rows].transpose(1, 2)
            mask = g.layer_mask(window)
            if fp32:
                og = self._attend_fp32(qg, k_pages, v_pages, g)
            else:
                # whole pages are gathered (contiguous blocks), far cheaper than gathering slot by slot
                pages = g.key_pages.flatten()
                kg = k_pages.index_select(1, pages).view(kvh, b, p * ps, d).transpose(0, 1).to(q.dtype)
                vg = v_pages.index_select(1, pages).view(kvh, b, p * ps, d).transpose(0, 1).to(q.dtype)
                if self.batch_invariant:
                    og = self._attend_bf16(qg, kg, vg, g)
                else:
                    og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=self.scale, enable_gqa=True)
            if out is None:
                return og.transpose(1, 2).reshape(n, h * d)
            if g.row_span is not None:
                first, count = g.row_span
                out[first : first + count] = og.transpose(1, 2).reshape(count, h, d)
            else:
                out[g.valid_rows] = og.transpose(1, 2)[g.query_valid]  # (B, Q, h, D) → valid rows
        assert out is not None
        return out.view(n, h * d)

    def _attend_bf16(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """The batch-invariant bf16 form, with the group's additive mask made by the pass's first layer and kept
        for the others."""
        mask = g.layer_mask(self.window)
        bias = g.memo.get(("bf16", self.window))
        if bias is None:
            bias = g.memo[("bf16", self.window)] = attention_bias(mask)
        return attend_invariant(q, k, v, mask, self.scale, bias)  # type: ignore[arg-type]

    def _attend_fp32(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, g: AttentionGroup
    ) -> torch.Tensor:
        """The float32 form over the group's pages gathered into its padded key blocks, with the mask and the
        blocks' buffers made by the pass's first layer and kept for the others."""
        per_kv = self.heads // self.kv_heads
        memo = g.memo.get(("fp32", per_kv, self.window))
        if memo is None:
            memo = g.memo[("fp32", per_kv, self.window)] = (
                fp32_attention_bias(g.layer_mask(self.window), per_kv),
                Fp32KeyBlocks(g.key_pages, k_pages),
            )
        bias, blocks = cast(tuple[list[torch.Tensor], Fp32KeyBlocks], memo)
        kb, vb = blocks.gather(k_pages, v_pages)
        return attend_fp32_blocks(q, kb, vb, bias, self.scale)

    def forward(self, x, cos, sin, ctx: ForwardContext, kv: KVCache) -> torch.Tensor:
        return self.o_proj(self.attend(*self.project(x, cos, sin), ctx, kv))


def _one_span(groups: tuple[AttentionGroup, ...], n: int) -> bool:
    """True when the pass is one attention group whose queries are all ``n`` rows in order (a decode step,
    one verify window): its output is the layer's, with no scatter."""
    return len(groups) == 1 and groups[0].row_span == (0, n)


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


def _fp32_attention(q: torch.Tensor) -> bool:
    if FP32_ATTENTION is not None:
        return FP32_ATTENTION
    return q.device.type == "cpu" and not bf16_is_fast()


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_activation]
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj: nn.Module = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one matmul, once prepared for serving

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        h, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset
        self.input_layernorm = RMSNorm(h, eps, off)
        self.post_attention_layernorm = RMSNorm(h, eps, off)
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, off)
            self.post_feedforward_layernorm = RMSNorm(h, eps, off)
        self.rope_kind = cfg.rope_kind(layer)  # which of the model's rope tables this layer rotates by

    def forward(self, x, cos, sin, ctx: ForwardContext, kv: KVCache) -> torch.Tensor:
        attn = self.self_attn
        return self.finish(x, attn.attend(*attn.project(self.input_layernorm(x), cos, sin), ctx, kv))

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer after its attention: ``x`` the layer's input, ``attended`` (N, h * D) before o_proj."""
        a = self.self_attn.o_proj(attended)
        if self.sandwich:  # Gemma: the norms wrap each block's output too, post_attention_layernorm among them
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)


class LlamaForCausalLM(nn.Module):
    """``embed`` → ``forward`` (final hidden states, normed) → ``logits`` on the rows read out."""

    attention_scores = True  # a pass can read the attention mass out (ForwardContext.scores)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg)  # the full-attention layers' table (what drafters and compiled passes use)
        self.rotaries = {cfg.rope_kind(i): Rotary(cfg, *cfg.layer_rope(i)) for i in range(cfg.num_hidden_layers)}
        self.embed_scale = cfg.embed_scale

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        e = self.model.embed_tokens(token_ids)
        if self.embed_scale != 1.0:  # Gemma: sqrt(hidden), rounded to the table's dtype first as transformers does
            e = e * torch.tensor(self.embed_scale, dtype=e.dtype)
        return e

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, ctx: ForwardContext, kv: KVCache, state: object = None) -> torch.Tensor:
        """hidden: (N, H) input embeddings → (N, H) final hidden states after the last norm. ``state``: the
        recurrent-state pool, which this family does not use (the engine passes every family the same)."""
        tables = {kind: r.cos_sin(ctx.positions, hidden.dtype) for kind, r in self.rotaries.items()}
        for layer in cast(list[DecoderLayer], list(self.model.layers)):
            hidden = layer(hidden, *tables[layer.rope_kind], ctx, kv)
        return self.model.norm(hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) final hidden states → (R, V) float32 logits."""
        return self.lm_head(hidden).float()
