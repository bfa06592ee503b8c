"""The attention readout's side of a forward: at the rows a pass reads it at, the softmax probability each key the
row attends got, summed over the query heads, per layer or summed over the layers too (protocol ``Readout``
``attention``). Only a pass that asks for it carries a :class:`PassScores` (``ForwardContext.scores``), so an
ordinary pass pays nothing.

A row's keys are the sequence indices it attends, as the attention sees them (context.py): all before it, or for a
tree window's row those before the window and its ancestors. Its output is indexed by sequence index (the working
set's row, which after an eviction is not the position rope gave it), ``width`` of them; a key it does not attend
stays exactly 0. Row by row, from the row's query and its own keys alone, so a row's bits do not depend on the
rest of the batch: torch's path (:meth:`PassScores.add`, one matmul of one shape per row and layer) recomputes
``softmax(q k^T / sqrt(D))`` in float32; the native step recomputes its own scores with its own maximum and
normaliser (kernels/native/attention.h, ``head_mass``) into :attr:`PassScores.flat`.

A sliding layer (models/kv_groups.py) attends only its window: its mass covers those keys, read through its page
group's table, and the keys before its window stay 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .context import Segment, window_mask
from .kv_groups import KVLayout


@dataclass(frozen=True)
class ScoreRow:
    """A row of a pass that the attention readout reads."""

    row: int  # the row in the pass's batch
    width: int  # sequence indices of its output, 0 .. width-1 (at least the row's own plus one)
    per_layer: bool  # one output row per layer, else the layers summed (in layer order)


def locate(segments: list[Segment], row: int) -> tuple[Segment, int]:
    """The segment batch row ``row`` belongs to, and its row in that segment."""
    first = 0
    for seg in segments:
        if row < first + seg.n_rows:
            return seg, row - first
        first += seg.n_rows
    raise ValueError(f"row {row} is past the pass's rows")


def visible(seg: Segment, i: int, window: int | None = None) -> np.ndarray:
    """The sequence indices row ``i`` of ``seg`` attends at ``window`` (None: a global layer), ascending
    (context.py's rule)."""
    keys = seg.start + seg.n_rows
    return np.flatnonzero(window_mask(seg, window, 0, keys)[i].numpy())


class PassScores:
    """The score rows of one pass and their outputs: row i's is ``out[i]``, (layers, width) or (1, width),
    float32, views into one zeroed buffer ``flat`` (what the native step writes)."""

    def __init__(
        self,
        rows: list[ScoreRow],
        segments: list[Segment],
        page_size: int,
        layers: int,
        device,
        layout: KVLayout | None = None,
    ):
        self.rows = rows
        layout = layout or KVLayout.single(layers)
        # per layer, its (page group, window); each such view's keys of each row, and their slots in its pages
        self.layer_key = list(zip(layout.layer_group, layout.layer_window))
        self.views: dict[tuple[int, int | None], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for group, window in dict.fromkeys(self.layer_key):
            seqs, slots = [], []
            for r in rows:
                seg, i = locate(segments, r.row)
                seq = torch.from_numpy(visible(seg, i, window)).to(device)
                if int(seq[-1]) >= r.width:
                    raise ValueError(
                        f"score row {r.row} attends sequence index {int(seq[-1])}, past its width {r.width}"
                    )
                table = torch.tensor(seg.table(group), dtype=torch.int64, device=device)
                seqs.append(seq)
                slots.append(table[seq // page_size] * page_size + seq % page_size)
            self.views[(group, window)] = (seqs, slots)
        sizes = [(layers if r.per_layer else 1) * r.width for r in rows]
        self.at = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.flat = torch.zeros(int(self.at[-1]), dtype=torch.float32, device=device)
        self.out = [self.flat[int(a) : int(a) + n].view(-1, r.width) for a, n, r in zip(self.at[:-1], sizes, rows)]

    def add(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
        """Torch's path: adds layer ``layer``'s mass, from q (N, h, D) rotated and this layer's pool keys
        k_cache (kvh, slots, D)."""
        kvh, d = k_cache.shape[0], k_cache.shape[2]
        seqs, slot_lists = self.views[self.layer_key[layer]]
        for r, seq, slots, out in zip(self.rows, seqs, slot_lists, self.out):
            qr = q[r.row].float().view(kvh, -1, d)  # (kvh, g, D): heads of a key head are adjacent
            kr = k_cache.index_select(1, slots).float()  # (kvh, K, D)
            p = torch.softmax(torch.matmul(qr, kr.transpose(1, 2)) * scale, dim=-1)  # (kvh, g, K)
            out[layer if r.per_layer else 0].index_add_(0, seq, p.sum((0, 1)))

    def results(self) -> list[torch.Tensor]:
        """Each row's output: (layers, width) per layer, else (width,)."""
        return [o if r.per_layer else o[0] for r, o in zip(self.rows, self.out)]
