"""Where each row of a pass sits, as the native step reads it (``attention.h``'s ``PassLayout``): one layout per
attention group of layers. A row's list of keys is its path (every sequence index before it, or before its tree
window, then its ancestors inside the window, itself last); a sliding layer's layout also says how many keys at
the front of that list left its window (``row_skip``), so the step lists and reads only the window's keys.

The window is applied on positions, as the torch path applies it (context.py, ``AttentionGroup.layer_mask``): a
query at position p keeps the keys at positions q with p - q < W, a key's position counted back from its row's
segment (consecutive before a tree window, the window's row 0 plus its depth inside one). Positions increase along
a row's list, so the keys it drops are a prefix of it. A row always keeps its own key (explicit positions that
would drop it are not the engine's: it gives a row the position after the rows before it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .attention_scores import PassScores
from .context import Segment, ancestor_mask
from .native_abi import PassLayout, PiePass


@dataclass
class PassArrays:
    """One layout's arrays (int32 unless named), alive while the step that reads them runs."""

    row_seg: np.ndarray
    row_limit: np.ndarray
    row_extra: np.ndarray
    extras: np.ndarray
    seg_pages: np.ndarray
    pages: np.ndarray
    write_slots: np.ndarray  # int64
    page_size: int
    max_keys: int
    row_skip: np.ndarray | None = None

    @staticmethod
    def build(
        segments: tuple[Segment, ...], n_rows: int, page_size: int, write_slots: np.ndarray, group: int = 0
    ) -> PassArrays:
        """Every row's whole list (a layer without a window), read through KV page group ``group``'s tables
        (models/kv_groups.py; a sliding group's lets go of the pages before its window, which ``windowed``'s
        skips never reach)."""
        seg_of, limits, extra_counts, extras = [], [], [], []
        for s, seg in enumerate(segments):
            seg_of.append(np.full(seg.n_rows, s, dtype=np.int32))
            if seg.parents is None:
                limits.append(np.arange(seg.start + 1, seg.start + seg.n_rows + 1, dtype=np.int32))
                extra_counts.append(np.zeros(seg.n_rows, dtype=np.int32))
                continue
            first = seg.start - seg.window  # window row of the segment's row 0
            anc = ancestor_mask(seg.parents).numpy()
            limits.append(np.full(seg.n_rows, seg.window, dtype=np.int32))
            for r in range(first, first + seg.n_rows):
                extras.append(np.flatnonzero(anc[r]).astype(np.int32) + seg.window)
            extra_counts.append(anc[first : first + seg.n_rows].sum(1).astype(np.int32))
        row_limit = np.concatenate(limits) if limits else np.zeros(0, np.int32)
        counts = np.concatenate(extra_counts) if extra_counts else np.zeros(0, np.int32)
        if len(row_limit) != n_rows:
            raise ValueError("the segments' rows do not add up to the pass's rows")
        tables = [np.asarray(seg.table(group), dtype=np.int32) for seg in segments]
        return PassArrays(
            row_seg=np.concatenate(seg_of).astype(np.int32) if seg_of else np.zeros(0, np.int32),
            row_limit=row_limit,
            row_extra=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            extras=np.concatenate(extras).astype(np.int32) if extras else np.zeros(1, np.int32),
            seg_pages=np.concatenate([[0], np.cumsum([len(t) for t in tables])]).astype(np.int32),
            pages=np.concatenate(tables).astype(np.int32) if tables else np.zeros(1, np.int32),
            write_slots=np.ascontiguousarray(write_slots, dtype=np.int64),
            page_size=page_size,
            max_keys=int((row_limit + counts).max()) if n_rows else 0,
        )

    def windowed(self, segments: tuple[Segment, ...], positions: np.ndarray, window: int) -> PassArrays:
        """The same rows for a layer attending to ``window`` positions (the module's rule)."""
        skips = [_skips(seg, positions[r0 : r0 + seg.n_rows], window) for seg, r0 in zip(segments, _starts(segments))]
        skip = np.concatenate(skips).astype(np.int32) if skips else np.zeros(0, np.int32)
        return replace(self, row_skip=skip)

    def struct(self) -> PassLayout:
        arrays = (self.row_seg, self.row_limit, self.row_extra, self.extras, self.seg_pages, self.pages)
        skip = self.row_skip.ctypes.data if self.row_skip is not None else None
        return PassLayout(
            *(a.ctypes.data for a in arrays), self.write_slots.ctypes.data, skip, self.page_size, self.max_keys
        )


def _starts(segments: tuple[Segment, ...]) -> list[int]:
    return np.concatenate([[0], np.cumsum([s.n_rows for s in segments])])[:-1].tolist()


def _skips(seg: Segment, pos: np.ndarray, window: int) -> np.ndarray:
    """Keys each of ``seg``'s rows (at query positions ``pos``) drops from the front of its list: those at
    positions q <= p - window."""
    cut = pos.astype(np.int64) - window  # keys at positions <= cut are out of the window
    if seg.parents is None:
        offset = int(pos[0]) - seg.start  # key j sits at position j + offset
        own = seg.start + np.arange(seg.n_rows)  # the row's own key: last of its list
        return np.clip(cut - offset + 1, 0, own)
    depth: list[int] = []
    for parent in seg.parents:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    first = seg.start - seg.window  # window row of the segment's row 0
    base = int(pos[0]) - depth[first]  # the position of window row 0
    prefix = np.clip(cut - (base - seg.window) + 1, 0, seg.window)
    # the ancestors (depths 0 .. own depth, positions base + depth) drop where the whole prefix has
    inside = np.clip(cut - base + 1, 0, np.array(depth[first : first + seg.n_rows]))
    return np.where(prefix == seg.window, prefix + inside, prefix)


def score_fields(p: PiePass, scores: PassScores | None) -> list[np.ndarray]:
    """Points the pass's score fields at the attention readout's rows and buffer (none: an ordinary pass);
    returns the arrays to keep alive while the step runs."""
    if scores is None:
        return []
    arrays = [
        np.array([r.row for r in scores.rows], dtype=np.int32),
        np.ascontiguousarray(scores.at[:-1], dtype=np.int64),
        np.array([r.width for r in scores.rows], dtype=np.int32),
        np.array([r.per_layer for r in scores.rows], dtype=np.int32),
    ]
    p.n_scores = len(scores.rows)
    p.score_rows, p.score_at, p.score_width, p.score_layered = (a.ctypes.data for a in arrays)
    p.scores = scores.flat.data_ptr()
    return arrays
