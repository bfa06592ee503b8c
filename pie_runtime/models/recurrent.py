"""Recurrent layers over a ragged batch: a causal depthwise convolution and Mamba's selective scan, each
reading its sequences' states from the state pool (``state_cache.py``) and writing them back advanced.

A batch holds N rows of B sequences; :class:`StateLayout` pads them into a (B, T) grid (T the longest
segment), so one call covers every sequence and a scan step covers one row of each. A sequence's state after
its segment is taken at its own length, so padding never enters a state.

Per-row states: a segment may also name entries for the state after each of its first rows
(``StateLayout.keep``). Both layers have it at hand: the convolution's state after row t is the K-1 inputs
ending at t, a slice of the inputs it already concatenates; the scan's is its h after step t, which it computes
anyway. A fold of fewer rows than ran then copies one of them instead of running the rows again
(engine/fold.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateLayout:
    """Where each sequence's rows sit in the batch and which state-pool entry it advances."""

    rows: torch.Tensor  # (B, T) int64 batch row of each step (padding repeats the segment's first row)
    valid: torch.Tensor  # (B, T) bool
    lengths: torch.Tensor  # (B,) int64 rows of each segment
    entries: torch.Tensor  # (B,) int64 state-pool entry of each segment
    keep: torch.Tensor | None = None  # (B, T) int64 entry receiving the state after each step (-1: none)
    keep_steps: int = 0  # steps 0 .. keep_steps-1 hold every kept state

    @staticmethod
    def build(
        row_start: list[int], n_rows: list[int], entries: list[int], device, keep: list[list[int]] | None = None
    ) -> StateLayout:
        """``keep[i]``: entries for the state after each of segment i's first ``len(keep[i])`` rows."""
        b, t = len(n_rows), max(n_rows)
        rows = torch.zeros(b, t, dtype=torch.int64)
        valid = torch.zeros(b, t, dtype=torch.bool)
        for i, (r0, n) in enumerate(zip(row_start, n_rows)):
            rows[i, :n] = torch.arange(r0, r0 + n)
            rows[i, n:] = r0
            valid[i, :n] = True
        steps = max((len(k) for k in keep), default=0) if keep else 0
        kept = None
        if steps:
            kept = torch.full((b, steps), -1, dtype=torch.int64)
            for i, k in enumerate(keep or []):
                kept[i, : len(k)] = torch.tensor(k, dtype=torch.int64)
            kept = kept.to(device)
        return StateLayout(
            rows=rows.to(device),
            valid=valid.to(device),
            lengths=torch.tensor(n_rows, dtype=torch.int64, device=device),
            entries=torch.tensor(entries, dtype=torch.int64, device=device),
            keep=kept,
            keep_steps=steps,
        )

    def store_rows(self, state: torch.Tensor, per_step: torch.Tensor) -> None:
        """Writes the kept states: ``per_step`` (B, keep_steps, ...) the state after each of the first steps."""
        assert self.keep is not None
        mask = self.keep >= 0
        state[self.keep[mask]] = per_step[mask].to(state.dtype)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) rows → (B, T, ...), padding zeroed."""
        g = x[self.rows]
        return g * self.valid.view(*self.valid.shape, *([1] * (x.dim() - 1))).to(g.dtype)

    def unpad(self, y: torch.Tensor, n: int) -> torch.Tensor:
        """(B, T, ...) → (N, ...): each valid step back to its batch row."""
        out = y.new_empty(n, *y.shape[2:])
        out[self.rows[self.valid]] = y[self.valid]
        return out


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lay: StateLayout
) -> torch.Tensor:
    """Depthwise causal convolution of kernel K over each sequence's rows, continuing from its last K-1
    inputs. x (N, C); state (entries, C, K-1), updated to the last K-1 inputs of each segment; weight (C, 1, K)."""
    k = weight.shape[-1]
    b, c = lay.rows.shape[0], x.shape[1]
    xs = lay.pad(x).transpose(1, 2)  # (B, C, T)
    full = torch.cat([state[lay.entries].to(x.dtype), xs], dim=-1)  # (B, C, K-1+T)
    # K shifted products, not F.conv1d: torch's CPU depthwise conv1d is pathologically slow at these shapes
    # (docs/performance.md, "Recurrent state")
    out = (full.unfold(-1, k, 1) * weight.view(1, c, 1, k)).sum(-1)  # (B, C, T)
    if bias is not None:
        out = out + bias.view(1, c, 1)
    idx = (lay.lengths.unsqueeze(1) + torch.arange(k - 1, device=x.device)).unsqueeze(1).expand(b, c, k - 1)
    state[lay.entries] = full.gather(2, idx).to(state.dtype)
    if lay.keep is not None:  # after step t: the K-1 inputs ending at t, full[..., t+1 : t+K]
        windows = full[..., 1 : lay.keep_steps + k - 1].unfold(-1, k - 1, 1)  # (B, C, keep_steps, K-1)
        lay.store_rows(state, windows.transpose(1, 2))
    return lay.unpad(out.transpose(1, 2), x.shape[0])


def selective_scan(
    u: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    bm: torch.Tensor,
    cm: torch.Tensor,
    state: torch.Tensor,
    lay: StateLayout,
) -> torch.Tensor:
    """Mamba's selective scan (Gu & Dao 2023, Algorithm 2), h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t and
    y_t = C_t h_t, in float32, one step for all sequences at a time. u, dt (N, D) (dt after softplus);
    a (D, S); bm, cm (N, S); state (entries, D, S), updated to each segment's last h. Returns y (N, D)."""
    us, dts = lay.pad(u.float()), lay.pad(dt.float())  # (B, T, D)
    bs, cs = lay.pad(bm.float()), lay.pad(cm.float())  # (B, T, S)
    da = torch.exp(a[None, None] * dts.unsqueeze(-1))  # (B, T, D, S)
    dbu = dts.unsqueeze(-1) * bs.unsqueeze(2) * us.unsqueeze(-1)  # (B, T, D, S)
    h = state[lay.entries].float()  # (B, D, S)
    ys, hs = [], []
    for t in range(us.shape[1]):
        nxt = da[:, t] * h + dbu[:, t]
        h = torch.where(lay.valid[:, t, None, None], nxt, h)
        ys.append(torch.matmul(nxt, cs[:, t].unsqueeze(-1)).squeeze(-1))  # (B, D)
        if t < lay.keep_steps:
            hs.append(h)
    state[lay.entries] = h.to(state.dtype)
    if hs:
        lay.store_rows(state, torch.stack(hs, dim=1))  # (B, keep_steps, D, S)
    return lay.unpad(torch.stack(ys, dim=1), u.shape[0])
