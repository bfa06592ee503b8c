"""Per-row states of the recurrent layers (models/recurrent.py): the state a layer keeps after row t of a
segment equals the state it ends in when it runs only rows 0..t, for a ragged batch of two sequences, both the
causal convolution and the selective scan."""

from __future__ import annotations

import torch

from pie_runtime.models.recurrent import StateLayout, causal_conv, selective_scan

C, K, S = 6, 4, 3
LENGTHS = [5, 3]  # two segments, rows concatenated
KEEP = [[4, 5, 6, 7], [8, 9]]  # entries receiving the state after each of their first rows (0, 1: live)


def layout(lengths: list[int], keep: list[list[int]] | None = None) -> StateLayout:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return StateLayout.build(starts, lengths, [0, 1][: len(lengths)], "cpu", keep)


def rows_of(x: torch.Tensor, n: list[int]) -> torch.Tensor:
    """The first n[i] rows of each segment of ``x`` (rows laid out by LENGTHS)."""
    starts = [0, LENGTHS[0]]
    return torch.cat([x[s : s + k] for s, k in zip(starts, n)])


def test_the_conv_keeps_the_state_after_each_row():
    torch.manual_seed(0)
    x, w = torch.randn(sum(LENGTHS), C), torch.randn(C, 1, K)
    start = torch.randn(10, C, K - 1)
    state = start.clone()
    causal_conv(x, state, w, None, layout(LENGTHS, KEEP))
    for i, entries in enumerate(KEEP):
        for t, entry in enumerate(entries):
            ref = start.clone()
            n = [t + 1 if j == i else 1 for j in range(2)]
            causal_conv(rows_of(x, n), ref, w, None, layout(n))
            torch.testing.assert_close(state[entry], ref[i], rtol=0, atol=0)
    assert torch.equal(state[2:4], start[2:4])  # entries no segment names are untouched


def test_the_scan_keeps_the_state_after_each_row():
    torch.manual_seed(0)
    n_rows = sum(LENGTHS)
    u, dt = torch.randn(n_rows, C), torch.rand(n_rows, C)
    bm, cm, a = torch.randn(n_rows, S), torch.randn(n_rows, S), -torch.rand(C, S)
    start = torch.randn(10, C, S)
    state = start.clone()
    selective_scan(u, dt, a, bm, cm, state, layout(LENGTHS, KEEP))
    for i, entries in enumerate(KEEP):
        for t, entry in enumerate(entries):
            ref = start.clone()
            n = [t + 1 if j == i else 1 for j in range(2)]
            part = [rows_of(v, n) for v in (u, dt, bm, cm)]
            selective_scan(part[0], part[1], a, part[2], part[3], ref, layout(n))
            torch.testing.assert_close(state[entry], ref[i], rtol=1e-6, atol=1e-6)
