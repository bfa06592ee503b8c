"""KV page groups: which page table each attention layer reads, and where its K/V sit in the pool
(docs/working-sets.md, "Page groups: sliding layers hold only their window"; issue 56).

Layers of one attention kind (global, or sliding with window W) share a page table: a sliding kind's table
holds only the pages of its last W rows (engine/kv_pages.py drops the others as the committed length grows).
Every page of the pool is the same size, so the engine's one page pool serves every group and a page is any
group's (as vLLM's hybrid KV cache manager does): a page holds ``unit`` layers, the greatest common divisor
of the kinds' layer counts, and a kind of ``n`` layers is ``n / unit`` page groups, each with its own table.
Gemma 3 270M (3 global layers, 15 sliding): pages of 3 layers, 1 global group and 5 sliding ones. A model
with one kind is one group of every layer: the pool and its tables exactly as before page groups.

``swa_full`` keeps every layer's rows (one group, as llama-server's ``--swa-full``); the layers still attend
only their window (``layer_window``), so its outputs equal the paged run's, bit for bit: the all-global
reference of the tests.

Torch-free: the engine imports it for the groups' windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import ceil, gcd


@dataclass(frozen=True)
class KVLayout:
    windows: tuple[int | None, ...]  # per page group: the rows its tables keep (None: every row)
    layer_group: tuple[int, ...]  # per KV layer (a drafter's extra layers last): the page group it reads
    layer_row: tuple[int, ...]  # per KV layer: its layer in the pool's storage (0 .. unit-1)
    layer_window: tuple[int | None, ...]  # per KV layer: the rows it attends (None: every earlier row)
    unit: int  # layers one page holds (0 for a model without attention layers)

    @property
    def groups(self) -> int:
        return len(self.windows)

    @property
    def sliding(self) -> bool:
        """Whether some group keeps only a window of rows."""
        return any(w is not None for w in self.windows)

    @staticmethod
    def single(layers: int) -> KVLayout:
        """Every layer global, one group: the layout of a model without sliding layers."""
        return KVLayout((None,), (0,) * layers, tuple(range(layers)), (None,) * layers, layers)

    @staticmethod
    def of(attention_windows: list[int | None], extra_layers: int = 0, swa_full: bool = False) -> KVLayout:
        """The layout of KV layers attending ``attention_windows`` (``ModelConfig.attention_window`` of each
        KV layer), then ``extra_layers`` global ones (a drafter's)."""
        attend = list(attention_windows) + [None] * extra_layers
        keep = [None if swa_full else w for w in attend]
        kinds = sorted(set(keep), key=lambda w: -1 if w is None else w)  # global first
        n = len(attend)
        if len(kinds) <= 1:
            return KVLayout((kinds[0] if kinds else None,), (0,) * n, tuple(range(n)), tuple(attend), n)
        counts = [keep.count(kind) for kind in kinds]
        unit = 0
        for c in counts:
            unit = gcd(unit, c)
        windows: list[int | None] = []
        base: dict[int | None, int] = {}
        for kind, c in zip(kinds, counts):
            base[kind] = len(windows)
            windows += [kind] * (c // unit)
        seen = dict.fromkeys(kinds, 0)
        group, row = [], []
        for kind in keep:
            i = seen[kind]
            seen[kind] += 1
            group.append(base[kind] + i // unit)
            row.append(i % unit)
        return KVLayout(tuple(windows), tuple(group), tuple(row), tuple(attend), unit)


def attention_windows(cfg: object) -> list[int | None]:
    """``cfg.attention_window(layer)`` of each KV layer; every layer global for a config without windows."""
    layers = int(getattr(cfg, "kv_layers", 0))
    window = getattr(cfg, "attention_window", None)
    if window is None:
        return [None] * layers
    return [window(i) for i in range(layers)]


def window_span(window: int, chunk_rows: int, page_size: int) -> int:
    """Rows of a fire a sliding group (window ``window``) holds pages for while the fire's pages move along its
    chunks of ``chunk_rows`` rows (engine/kv_pages.py ``reserve(moving=True)``): the window and a chunk, with a
    page of slack at either end and the fire's first page."""
    return window + chunk_rows + 3 * page_size


def group_pages_bound(rows: int, window: int | None, page_size: int, chunk_rows: int) -> int:
    """The most pages one page group holds for a working set that grows to ``rows`` rows: every row's page for a
    global group; a sliding group's window span and one page of slack (a verify window of up to a chunk past the
    committed rows included), never more than every row's."""
    every = ceil(rows / page_size)
    if window is None:
        return every
    return min(every, ceil(window_span(window, chunk_rows, page_size) / page_size) + 1)


def pages_bound(rows: int, windows: Sequence[int | None], page_size: int, chunk_rows: int) -> int:
    """``group_pages_bound`` summed over the page groups ``windows``: the pool pages the working set may hold."""
    return sum(group_pages_bound(rows, w, page_size, chunk_rows) for w in windows)
