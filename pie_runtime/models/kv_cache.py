"""The paged KV pool's tensors: per attention layer, K and V for ``num_pages * page_size`` slots. Which pages belong
to whom is the engine's business (``engine/page_pool.py``); this module only stores and moves bytes.

The layout is head-major, ``(layers, kv_heads, slots, head_dim)``: gathering a sequence's pages gives each head's
keys in one contiguous run, the layout attention multiplies, so the gather is the only copy on the way (the
float32 attention of CPUs without bf16 units converts it in one contiguous pass, where slot-major pages took a
slower strided copy per head: docs/performance.md, "KV pool layout").

``extra_layers``: layers past the model's own, for a drafter that keeps K/V per position in the same pages
(an EAGLE head's draft layer, models/eagle.py), so that every page operation carries them too.

Page groups (models/kv_groups.py): a page holds ``layout.unit`` layers, and KV layer ``l`` lives in storage
layer ``layout.layer_row[l]`` of the pages of its group's table. A model with one attention kind: every layer,
one group, the layout this module always had."""

from __future__ import annotations

import mmap

import numpy as np
import torch

from .config import AnyConfig
from .kv_groups import KVLayout, attention_windows


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero tensor; on the CPU its pages become resident only when written (an anonymous mapping: the kernel's
    zero pages until then), so a pool sized for many sequences costs memory only as they fill it. Not numpy's
    allocator: it asks for transparent huge pages on large arrays, and the pool's head-major layout would then
    make a sequence's first token resident 2 MiB at a time in every layer and head (~360 MiB for the default
    model)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]  # the array keeps the mapping
    return torch.from_numpy(raw).view(dtype).view(shape)


class KVCache:
    def __init__(
        self,
        cfg: AnyConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device="cpu",
        extra_layers: int = 0,
        layout: KVLayout | None = None,
    ):
        self.num_pages = num_pages
        self.page_size = page_size
        # without a layout: one group keeping every row, each layer at its window (what a caller that knows no
        # page groups lays out); the engine passes the model's page groups (engine/build.py)
        self.layout = layout or self.layout_of(cfg, extra_layers, swa_full=True)
        shape = (self.layout.unit, cfg.num_key_value_heads, num_pages * page_size, cfg.head_dim)
        self.k = zeros(shape, dtype, device)
        self.v = zeros(shape, dtype, device)

    @staticmethod
    def bytes_per_page(
        cfg: AnyConfig, page_size: int, dtype: torch.dtype, extra_layers: int = 0, layout: KVLayout | None = None
    ) -> int:
        """0 for a model without attention layers (and no extra layers). A page holds ``layout.unit`` layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        layers = (layout or KVCache.layout_of(cfg, extra_layers, swa_full=True)).unit
        return 2 * layers * page_size * cfg.num_key_value_heads * cfg.head_dim * elem

    @staticmethod
    def layout_of(cfg: AnyConfig, extra_layers: int = 0, swa_full: bool = False) -> KVLayout:
        """The page groups of ``cfg``'s KV layers (models/kv_groups.py)."""
        return KVLayout.of(attention_windows(cfg), extra_layers, swa_full)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV layer ``layer``'s K and V storage, (kv_heads, slots, head_dim) each, indexed by its group's slots."""
        row = self.layout.layer_row[layer]
        return self.k[row], self.v[row]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages (copy-on-write of a shared page before it is written)."""
        ps = self.page_size
        s = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in src]).to(self.k.device)
        d = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in dst]).to(self.k.device)
        self.k[:, :, d] = self.k[:, :, s]
        self.v[:, :, d] = self.v[:, :, s]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy single rows between slots, every layer (a tree fold moving its path's rows into place). The
        sources are read in full before any destination is written, so the two may overlap."""
        s = torch.tensor(src, dtype=torch.int64, device=self.k.device)
        d = torch.tensor(dst, dtype=torch.int64, device=self.k.device)
        self.k[:, :, d] = self.k[:, :, s]
        self.v[:, :, d] = self.v[:, :, s]
