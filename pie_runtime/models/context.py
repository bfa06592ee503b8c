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

KV page groups (models/kv_groups.py): a segment carries one page table per group (``Segment.table``), and the
context one :class:`KVView` per (group, attention window) that some layer reads: the slots its rows write in that
group's pages and the attention calls over them. A layer finds its view by ``ForwardContext.view(layer)``. A
sliding view's calls gather only the pages from the one holding sequence index ``i - W + 1`` of its segment's first
query ``i`` (a tree window's: the window's first index), the first key the position window can keep, so a sliding
layer never reads the pages its group has let go of (engine/kv_pages.py keeps every page from there on). A model
of one global group has one view: the context as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .kv_groups import KVLayout
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
    group_tables: tuple[list[int], ...] = ()  # the page tables of page groups 1.. (kv_groups.py), in group order

    def table(self, group: int) -> list[int]:
        """Page group ``group``'s table (group 0's is ``page_table``); -1 marks a page the group let go."""
        return self.page_table if group == 0 else self.group_tables[group - 1]


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
class KVView:
    """What the layers of one page group and attention window read: where each row's K/V is written in the
    group's pages, and the attention calls over them."""

    write_slots: torch.Tensor  # (N,) int64
    groups: tuple[AttentionGroup, ...]


@dataclass(frozen=True)
class ForwardContext:
    positions: torch.Tensor  # (N,) int64 RoPE position of each row
    write_slots: torch.Tensor  # (N,) int64 slot each row's K/V is written to (page group 0)
    groups: tuple[AttentionGroup, ...]  # () when built for a model that attends natively (``torch_groups=False``)
    states: StateLayout | None = None  # each segment's recurrent state, when its segments name one
    segments: tuple[Segment, ...] = ()  # the pass's segments, rows in this order
    scores: PassScores | None = None  # the attention readout's rows and buffers, on a pass that reads it
    views: tuple[KVView, ...] = ()  # per (page group, window) some layer reads; () : one view, the fields above
    layer_view: tuple[int, ...] = ()  # per KV layer: its view

    def view(self, layer: int) -> KVView:
        """The write slots and attention calls of KV layer ``layer`` (its page group's, at its window)."""
        if not self.layer_view:
            return KVView(self.write_slots, self.groups)
        return self.views[self.layer_view[layer]]

    @staticmethod
    def build(
        segments: list[Segment],
        page_size: int,
        device: torch.device | str = "cpu",
        positions: list[int] | None = None,
        torch_groups: bool = True,
        scores: PassScores | None = None,
        layout: KVLayout | None = None,
    ) -> ForwardContext:
        """Lay out ``segments`` (rows concatenated in this order). ``positions`` defaults to each row's
        sequence index; a caller may pass others (RoPE only; attention stays causal over the page table).
        ``torch_groups=False`` skips the padded attention groups (and their masks) of torch's attention, for a
        model that reads the segments' page tables itself (models/native_model.py). ``layout``: the model's page
        groups (one global group when None)."""
        page_groups = layout.groups if layout is not None else 1
        seq_index: list[int] = []
        row_start: list[int] = []
        n = 0
        for seg in segments:
            if seg.n_rows <= 0:
                raise ValueError("a segment needs at least one row")
            if len(seg.group_tables) < page_groups - 1:
                raise ValueError("a segment needs one page table per page group")
            if (seg.start + seg.n_rows + page_size - 1) // page_size > len(seg.page_table):
                raise ValueError("segment extends past its page table")
            row_start.append(n)
            seq_index.extend(range(seg.start, seg.start + seg.n_rows))
            n += seg.n_rows
        pos = seq_index if positions is None else list(positions)
        if len(pos) != n:
            raise ValueError("one position per row is required")
        keys: list[tuple[int, int | None]] = [(0, None)]
        if layout is not None:
            keys = (
                list(dict.fromkeys(zip(layout.layer_group, layout.layer_window))) or keys
            )  # a model without attention layers: the slots bound its rows all the same
        slots = {g: _write_slots(segments, g, page_size, device) for g in dict.fromkeys(g for g, _ in keys)}
        views = tuple(
            KVView(slots[g], _groups(segments, row_start, page_size, device, pos, g, w) if torch_groups else ())
            for g, w in keys
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
        first = views[0]
        return ForwardContext(
            positions=torch.tensor(pos, dtype=torch.int64, device=device),
            write_slots=first.write_slots,
            groups=first.groups,
            states=states,
            segments=tuple(segments),
            scores=scores,
            views=views if len(views) > 1 else (),
            layer_view=tuple(keys.index(k) for k in zip(layout.layer_group, layout.layer_window))
            if layout is not None and len(views) > 1
            else (),
        )


def _write_slots(segments: list[Segment], group: int, page_size: int, device) -> torch.Tensor:
    """The slot of each row of ``segments`` in page group ``group``'s pages."""
    out: list[int] = []
    for seg in segments:
        table = seg.table(group)
        if (seg.start + seg.n_rows + page_size - 1) // page_size > len(table):
            raise ValueError("segment extends past its page table")
        out.extend(table[j // page_size] * page_size + j % page_size for j in range(seg.start, seg.start + seg.n_rows))
    return torch.tensor(out, dtype=torch.int64, device=device)


def _groups(
    segments: list[Segment],
    row_start: list[int],
    page_size: int,
    device,
    pos: list[int],
    table: int,
    window: int | None,
) -> tuple[AttentionGroup, ...]:
    """The attention calls of one view: short segments padded into one call, each long one in its own."""
    short = [i for i, s in enumerate(segments) if s.n_rows <= SHORT_SEGMENT_ROWS]
    long = [i for i, s in enumerate(segments) if s.n_rows > SHORT_SEGMENT_ROWS]
    plans = ([short] if short else []) + [[i] for i in long]
    return tuple(
        _group([segments[i] for i in plan], [row_start[i] for i in plan], page_size, device, pos, table, window)
        for plan in plans
    )


def first_key(seg: Segment, window: int | None) -> int:
    """The first sequence index any row of ``seg`` attends at ``window`` (0 for a global layer): its first row's
    index (a tree window's: the window's first, its shallowest row's) less the window's other rows."""
    if window is None:
        return 0
    return max(0, (seg.start if seg.parents is None else seg.window) - window + 1)


def window_mask(seg: Segment, window: int | None, key0: int, keys: int) -> torch.Tensor:
    """(n_rows, keys) bool: which keys at sequence indices ``key0 .. key0+keys-1`` each row of ``seg`` attends."""
    kl = seg.start + seg.n_rows
    idx = torch.arange(key0, key0 + keys)
    if seg.parents is None:
        qi = torch.arange(seg.start, kl).unsqueeze(1)  # row r sits at sequence index start + r
        mask = idx.unsqueeze(0) <= qi  # (keys past the last row are past every row's own)
        return mask if window is None else mask & (idx.unsqueeze(0) > qi - window)
    first = seg.start - seg.window  # window row of the segment's row 0
    anc = ancestor_mask(seg.parents)[first : first + seg.n_rows]  # (n_rows, w)
    inside = torch.zeros(seg.n_rows, keys, dtype=torch.bool)
    lo, hi = max(key0, seg.window), min(key0 + keys, kl)
    if hi > lo:
        inside[:, lo - key0 : hi - key0] = anc[:, lo - seg.window : hi - seg.window]
    mask = (idx < seg.window).unsqueeze(0) | inside
    if window is None:
        return mask
    all_depth = ancestor_mask(seg.parents).sum(1) - 1  # a root is at depth 0
    depth = all_depth[first : first + seg.n_rows]
    # a key inside the window sits at the window's first index plus its own depth
    key_at = idx.clone()
    sel = (idx >= seg.window) & (idx < kl)
    key_at[sel] = seg.window + all_depth[idx[sel] - seg.window]
    qi = (seg.window + depth).unsqueeze(1)
    return mask & (key_at.unsqueeze(0) > qi - window)


def _group(
    segments: list[Segment],
    row_start: list[int],
    page_size: int,
    device,
    pos: list[int],
    table: int = 0,
    window: int | None = None,
) -> AttentionGroup:
    """One attention call over ``segments``' keys in page group ``table``; at ``window``, only the pages from
    the one holding the first key a row may attend (``first_key``), so a sliding layer never reads the pages
    its group let go of. The mask is causal (or a tree window's); ``AttentionGroup.layer_mask`` narrows it to
    the window by positions, from ``query_pos`` and ``key_pos``."""
    b = len(segments)
    q = max(s.n_rows for s in segments)
    first_page = [first_key(s, window) // page_size for s in segments]
    used = [(s.start + s.n_rows + page_size - 1) // page_size for s in segments]
    p = max(u - f for u, f in zip(used, first_page))
    k = p * page_size
    query_rows = torch.zeros(b, q, dtype=torch.int64)
    query_valid = torch.zeros(b, q, dtype=torch.bool)
    key_pages = torch.zeros(b, p, dtype=torch.int64)
    mask = torch.zeros(b, 1, q, k, dtype=torch.bool)
    # positions only for a view whose layers slide (``layer_mask``): a global view's calls never read them
    query_pos = torch.zeros(b, q, dtype=torch.int64) if window is not None else None
    key_pos = torch.zeros(b, k, dtype=torch.int64) if window is not None else None
    for i, (seg, r0) in enumerate(zip(segments, row_start)):
        f, u = first_page[i], used[i]
        if query_pos is not None and key_pos is not None:
            query_pos[i, : seg.n_rows], keys = _positions(seg, pos[r0 : r0 + seg.n_rows], f * page_size + k)
            key_pos[i] = keys[f * page_size :]  # key column c holds sequence index f * page_size + c
            query_pos[i, seg.n_rows :] = key_pos[i, 0]
        query_rows[i, : seg.n_rows] = torch.arange(r0, r0 + seg.n_rows)
        query_rows[i, seg.n_rows :] = r0
        query_valid[i, : seg.n_rows] = True
        key_pages[i, : u - f] = torch.tensor(seg.table(table)[f:u], dtype=torch.int64)
        mask[i, 0, : seg.n_rows, : (u - f) * page_size] = window_mask(seg, None, f * page_size, (u - f) * page_size)
        mask[i, 0, seg.n_rows :, 0] = True  # padding rows attend something, so softmax stays finite
    return AttentionGroup(
        query_rows=query_rows.to(device),
        query_valid=query_valid.to(device),
        key_pages=key_pages.to(device),
        mask=mask.to(device),
        valid_rows=query_rows[query_valid].to(device),
        query_pos=None if query_pos is None else query_pos.to(device),
        key_pos=None if key_pos is None else key_pos.to(device),
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
