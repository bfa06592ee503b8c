"""The explicit forward context: where each row of a ragged batch sits in the paged KV cache and which cache
slots it may attend. Model code receives this beside token ids; it knows nothing of requests or clients.

A *slot* is a flat index into the page pool: ``page * page_size + offset``. Row ``i`` of a sequence segment
that starts at sequence index ``start`` lives at sequence index ``start + i``; it writes its K/V into that
index's slot and attends every key at sequence index ``<= start + i`` (causal over the page table).

A segment of a *tree window* (docs/architecture.md, "Tree windows") carries the window's parent rows and the
sequence index its row 0 sits at: a row then attends every key before the window and, inside the window,
only itself and its ancestors, whichever chunk of the window wrote them.

A sliding-window layer (``ModelConfig.attention_window``) narrows a group's mask by positions:
:meth:`AttentionGroup.layer_mask` keeps the keys at positions q with p - q < W for a query at position p,
whichever pages hold them. A key's position is counted back from the query's segment (consecutive before a
tree window; its depth inside one).

A model with recurrent state (models/recurrent.py) also needs, per segment, the state-pool entry its rows
advance (``Segment.state``), and, where a fold may keep fewer rows than run, the entries that receive the state
after each of its first rows (``Segment.row_states``: per-row states, engine/fold.py); the context lays those out
as a :class:`StateLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .recurrent import StateLayout

if TYPE_CHECKING:
    from .attention_scores import PassScores

# Segments with at most this many query rows are padded into one attention call; longer ones (prefill
# chunks) get a call of their own so that a decode row never pays for a prefill's padding.
SHORT_SEGMENT_ROWS = 8


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a batch: ``n_rows`` consecutive rows written from sequence index ``start``."""

    page_table: list[int]  # physical page ids, in sequence order
    start: int
    n_rows: int
    parents: tuple[int, ...] | None = None  # a tree window's parent row of each window row (-1: a root)
    window: int = 0  # with parents: sequence index of the window's row 0 (start - window rows already ran)
    state: int | None = None  # state-pool entry the rows advance (models with recurrent state)
    row_states: tuple[int, ...] = ()  # state-pool entries that receive the state after each of the first rows


@dataclass(frozen=True)
class AttentionGroup:
    """A padded attention call over some segments: B sequences, Q query rows, K keys each."""

    query_rows: torch.Tensor  # (B, Q) int64 row index in the batch (padding repeats a valid row)
    query_valid: torch.Tensor  # (B, Q) bool
    key_pages: torch.Tensor  # (B, P) int64 pages in sequence order (padding repeats page 0); K = P * page_size
    mask: torch.Tensor  # (B, 1, Q, K) bool, True where the query may attend the key
    valid_rows: torch.Tensor  # (n,) int64 batch rows of the valid queries, in query_valid order
    # (first, count) when the group's queries are batch rows first..first + count - 1 in order with no padding
    # (a decode step, a verify window, segments of one length side by side): attention then slices the batch's
    # rows instead of gathering and scattering them
    row_span: tuple[int, int] | None = None
    # tensors derived from the mask once per pass and shared by every layer (the attention's additive mask)
    memo: dict[object, object] = field(default_factory=dict, compare=False, repr=False)
    query_pos: torch.Tensor | None = None  # (B, Q) int64 position of each query (padding: key 0's)
    key_pos: torch.Tensor | None = None  # (B, K) int64 position of each key

    def layer_mask(self, window: int | None) -> torch.Tensor:
        """The mask of a layer attending to ``window`` rows (None: every earlier row), made once per pass."""
        if window is None:
            return self.mask
        key = ("window", window)
        mask = self.memo.get(key)
        if mask is None:
            assert self.query_pos is not None and self.key_pos is not None
            near = (self.query_pos.unsqueeze(-1) - self.key_pos.unsqueeze(1)) < window  # (B, Q, K)
            mask = self.memo[key] = self.mask & near.unsqueeze(1)
        return mask  # type: ignore[return-value]


@dataclass(frozen=True)
class ForwardContext:
    positions: torch.Tensor  # (N,) int64 RoPE position of each row
    write_slots: torch.Tensor  # (N,) int64 slot each row's K/V is written to
    groups: tuple[AttentionGroup, ...]  # () when built for a model that attends natively (``torch_groups=False``)
    states: StateLayout | None = None  # each segment's recurrent state, when its segments name one
    segments: tuple[Segment, ...] = ()  # the pass's segments, rows in this order
    scores: PassScores | None = None  # the attention readout's rows and buffers, on a pass that reads it

    @staticmethod
    def build(
        segments: list[Segment],
        page_size: int,
        device: torch.device | str = "cpu",
        positions: list[int] | None = None,
        torch_groups: bool = True,
        scores: PassScores | None = None,
    ) -> ForwardContext:
        """Lay out ``segments`` (rows concatenated in this order). ``positions`` defaults to each row's
        sequence index; a caller may pass others (RoPE only; attention stays causal over the page table).
        ``torch_groups=False`` skips the padded attention groups (and their masks) of torch's attention, for a
        model that reads the segments' page tables itself (models/native_model.py)."""
        write_slots: list[int] = []
        seq_index: list[int] = []
        row_start: list[int] = []
        n = 0
        for seg in segments:
            if seg.n_rows <= 0:
                raise ValueError("a segment needs at least one row")
            if (seg.start + seg.n_rows + page_size - 1) // page_size > len(seg.page_table):
                raise ValueError("segment extends past its page table")
            row_start.append(n)
            for j in range(seg.start, seg.start + seg.n_rows):
                write_slots.append(seg.page_table[j // page_size] * page_size + j % page_size)
                seq_index.append(j)
            n += seg.n_rows
        pos = seq_index if positions is None else list(positions)
        if len(pos) != n:
            raise ValueError("one position per row is required")

        short = [i for i, s in enumerate(segments) if s.n_rows <= SHORT_SEGMENT_ROWS]
        long = [i for i, s in enumerate(segments) if s.n_rows > SHORT_SEGMENT_ROWS]
        plans = ([short] if short else []) + [[i] for i in long]
        groups = tuple(
            _group([segments[i] for i in plan], [row_start[i] for i in plan], page_size, device, pos)
            for plan in (plans if torch_groups else [])
        )
        entries = [s.state for s in segments]
        states = None
        if any(e is not None for e in entries):
            if any(e is None for e in entries):
                raise ValueError("either every segment names its recurrent state or none does")
            for s in segments:
                if len(s.row_states) > s.n_rows:
                    raise ValueError("a segment keeps at most one state per row")
            keep = [list(s.row_states) for s in segments]
            states = StateLayout.build(row_start, [s.n_rows for s in segments], entries, device, keep)  # type: ignore[arg-type]
        return ForwardContext(
            positions=torch.tensor(pos, dtype=torch.int64, device=device),
            write_slots=torch.tensor(write_slots, dtype=torch.int64, device=device),
            groups=groups,
            states=states,
            segments=tuple(segments),
            scores=scores,
        )


def _group(segments: list[Segment], row_start: list[int], page_size: int, device, pos: list[int]) -> AttentionGroup:
    b = len(segments)
    q = max(s.n_rows for s in segments)
    p = max((s.start + s.n_rows + page_size - 1) // page_size for s in segments)
    k = p * page_size
    query_rows = torch.zeros(b, q, dtype=torch.int64)
    query_valid = torch.zeros(b, q, dtype=torch.bool)
    key_pages = torch.zeros(b, p, dtype=torch.int64)
    mask = torch.zeros(b, 1, q, k, dtype=torch.bool)
    query_pos = torch.zeros(b, q, dtype=torch.int64)
    key_pos = torch.zeros(b, k, dtype=torch.int64)
    for i, (seg, r0) in enumerate(zip(segments, row_start)):
        query_pos[i, : seg.n_rows], key_pos[i] = _positions(seg, pos[r0 : r0 + seg.n_rows], k)
        query_pos[i, seg.n_rows :] = key_pos[i, 0]
        query_rows[i, : seg.n_rows] = torch.arange(r0, r0 + seg.n_rows)
        query_rows[i, seg.n_rows :] = r0
        query_valid[i, : seg.n_rows] = True
        kl = seg.start + seg.n_rows
        used = (kl + page_size - 1) // page_size
        key_pages[i, :used] = torch.tensor(seg.page_table[:used], dtype=torch.int64)
        if seg.parents is None:
            idx = torch.arange(kl)
            # query row r sits at sequence index start + r and sees keys 0..start + r
            qi = torch.arange(seg.start, kl).unsqueeze(1)
            mask[i, 0, : seg.n_rows, :kl] = idx.unsqueeze(0) <= qi
        else:
            first = seg.start - seg.window  # window row of the segment's row 0
            mask[i, 0, : seg.n_rows, : seg.window] = True
            mask[i, 0, : seg.n_rows, seg.window : kl] = ancestor_mask(seg.parents)[
                first : first + seg.n_rows, : kl - seg.window
            ]
        mask[i, 0, seg.n_rows :, 0] = True  # padding rows attend something, so softmax stays finite
    return AttentionGroup(
        query_rows=query_rows.to(device),
        query_valid=query_valid.to(device),
        key_pages=key_pages.to(device),
        mask=mask.to(device),
        valid_rows=query_rows[query_valid].to(device),
        query_pos=query_pos.to(device),
        key_pos=key_pos.to(device),
        row_span=(row_start[0], b * q)
        if all(s.n_rows == q for s in segments) and row_start == [row_start[0] + i * q for i in range(b)]
        else None,
    )


def _positions(seg: Segment, row_pos: list[int], n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the segment's query positions, a position for each of ``n_keys`` keys): keys consecutive up to the
    segment's first row (or a tree window's row 0), a tree window's rows at row 0's position plus their depth."""
    queries = torch.tensor(row_pos, dtype=torch.int64)
    keys = torch.arange(n_keys, dtype=torch.int64)
    if seg.parents is None:
        return queries, keys + (row_pos[0] - seg.start)
    depth: list[int] = []
    for parent in seg.parents:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    base = row_pos[0] - depth[seg.start - seg.window]  # the position of window row 0
    keys = keys + (base - seg.window)
    inside = min(len(depth), n_keys - seg.window)
    keys[seg.window : seg.window + inside] = base + torch.tensor(depth[:inside], dtype=torch.int64)
    return queries, keys


def ancestor_mask(parents: tuple[int, ...]) -> torch.Tensor:
    """(w, w) bool: row i's entry j is True when window row j is i or one of its ancestors."""
    w = len(parents)
    out = torch.eye(w, dtype=torch.bool)
    for row, parent in enumerate(parents):
        if parent >= 0:
            out[row] |= out[parent]
    return out
