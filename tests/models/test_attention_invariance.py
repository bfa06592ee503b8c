"""Both forms of the batch-invariant attention (models/llama.py: bf16 matmuls, and the float32 form of CPUs
without bf16 units) give a query row the same bits in a verify window, beside other sequences with longer keys
(more padding, garbage past each sequence's end) and alone; and both agree with float32 SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pie_runtime.models.attention_math import attend_invariant, attend_invariant_fp32

KVH, HEADS, D = 3, 9, 64
FORMS = {"bf16": attend_invariant, "fp32": attend_invariant_fp32}


def batch_call(attend, queries, keys, lengths, padded_to, gen):
    """Sequences side by side as the paged gather gives them: keys (B, K, kvh, D) viewed as (B, kvh, K, D),
    padded to ``padded_to`` with garbage, each row masked causally up to its own position."""
    b, q_max = len(queries), max(x.shape[0] for x in queries)
    k = torch.randn(b, padded_to, KVH, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(b, padded_to, KVH, D, generator=gen).to(torch.bfloat16)
    q = torch.zeros(b, HEADS, q_max, D, dtype=torch.bfloat16)
    mask = torch.zeros(b, 1, q_max, padded_to, dtype=torch.bool)
    for i, (qq, (kk, vv), n_keys) in enumerate(zip(queries, keys, lengths)):
        k[i, : kk.shape[0]], v[i, : vv.shape[0]] = kk, vv
        rows = qq.shape[0]
        q[i, :, :rows] = qq.transpose(0, 1)
        for r in range(rows):
            mask[i, 0, r, : n_keys - rows + r + 1] = True
    return attend(q, k.transpose(1, 2), v.transpose(1, 2), mask, D**-0.5), (q, k, v, mask)


def pages(n: int) -> int:
    return -(-n // 16) * 16


@pytest.mark.parametrize("form", FORMS)
def test_a_row_gets_the_same_bits_in_a_window_beside_others_and_alone(form):
    attend, gen = FORMS[form], torch.Generator().manual_seed(0)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    seq = lambda n: tuple(torch.randn(n, KVH, D, generator=gen).to(torch.bfloat16) for _ in "kv")  # noqa: E731
    for _ in range(25):
        n_keys, rows = rand(5, 700), rand(1, 9)
        keys, queries = seq(n_keys), torch.randn(rows, HEADS, D, generator=gen).to(torch.bfloat16)
        alone = [
            batch_call(attend, [queries[r : r + 1]], [keys], [n_keys - rows + r + 1], pages(n_keys), gen)[0][0, :, 0]
            for r in range(rows)
        ]
        window = batch_call(attend, [queries], [keys], [n_keys], pages(n_keys), gen)[0][0]
        others = [seq(rand(1, 900)) for _ in range(rand(1, 4))]
        other_q = [torch.randn(rand(1, 9), HEADS, D, generator=gen).to(torch.bfloat16) for _ in others]
        lengths = [n_keys] + [o[0].shape[0] for o in others]
        beside = batch_call(attend, [queries, *other_q], [keys, *others], lengths, pages(max(lengths)), gen)[0][0]
        for r in range(rows):
            assert torch.equal(window[:, r], alone[r]), (n_keys, rows, r)
            assert torch.equal(beside[:, r], alone[r]), (n_keys, rows, r)


@pytest.mark.parametrize("form", FORMS)
def test_both_forms_compute_attention(form):
    gen = torch.Generator().manual_seed(1)
    queries = [torch.randn(4, HEADS, D, generator=gen).to(torch.bfloat16) for _ in range(2)]
    keys = [tuple(torch.randn(n, KVH, D, generator=gen).to(torch.bfloat16) for _ in "kv") for n in (300, 40)]
    got, (q, k, v, mask) = batch_call(FORMS[form], queries, keys, [300, 40], 304, gen)
    want = F.scaled_dot_product_attention(
        q.float(), k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=mask, enable_gqa=True
    )
    for i, rows in enumerate((4, 4)):
        err = (got[i, :, :rows].float() - want[i, :, :rows]).norm() / want[i, :, :rows].norm()
        assert err < 0.01, f"{form}: relative error {err:.4f}"
