"""The models' linear layer, with optional oneDNN-prepacked weights for multi-row passes on CPU.

A speculative verify window is a pass of a few rows (1 + k drafts). In float32 on CPU, MKL's sgemm picks
a poor path for 4..16 rows, worst for the 49152-row lm head (docs/performance.md, "The prepacked fp32 lm
head"). oneDNN's matmul over weights reordered once into
its blocked layout (what torch inductor's CPU "freezing" and IPEX do) is nearly flat there, but slower
than MKL's gemv for a single row. So a prepacked layer keeps both: one row goes through ``F.linear``,
several through the packed copy. The cost is a second copy of each packed weight (see ``prepack``).

Both paths accumulate in float32 with their own summation order, as MKL's own paths for different row
counts already do; greedy equality between a window and single-row decode is tested end to end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACK_ROWS_HINT = 16  # the row count oneDNN tunes the blocked layout for (windows of 2..17 rows measured best)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict names) that can route multi-row inputs to a
    oneDNN-prepacked copy of its weight."""

    packed: torch.Tensor | None = None
    # bf16 batch invariance: oneDNN sums a row in another order depending on how many rows the call has (its
    # 1-row kernel, a partial tile's rows, and on CPUs with AMX another kernel for the lm head at 33-300
    # rows), so a bf16 layer takes its rows in slices of ``invariant_rows``, the last one padded: every
    # matmul has one shape, and a row's bits do not depend on its pass (0: one call, whatever the rows)
    invariant_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, n = self.invariant_rows, x.shape[0]
        if t and x.dim() == 2 and n:  # (no rows: F.linear below)
            padded = F.pad(x, (0, 0, 0, -n % t))
            return torch.cat([F.linear(c, self.weight, self.bias) for c in padded.split(t)])[:n]
        packed = self.packed
        if packed is None or x.dim() != 2 or x.shape[0] < 2 or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")


def prepack_available(module: nn.Module) -> bool:
    """True when the module's weights are float32 on CPU and this torch has oneDNN."""
    p = next(module.parameters(), None)
    return (
        p is not None and p.device.type == "cpu" and p.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


def prepack(module: nn.Module) -> int:
    """Give every :class:`Linear` in ``module`` a prepacked weight copy; returns the bytes added.
    Inference only: the copies do not follow later changes to the weights."""
    if not prepack_available(module):
        return 0
    added = 0
    for m in module.modules():
        if isinstance(m, Linear):
            w = m.weight.detach()
            m.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
            added += w.numel() * w.element_size()
    return added


def unpack(module: nn.Module) -> None:
    """Drop the prepacked copies (every pass goes through ``F.linear`` again)."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.packed = None
