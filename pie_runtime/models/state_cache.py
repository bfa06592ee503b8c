"""The recurrent-state pool's tensors: per recurrent layer, its state tensors (a convolution's last inputs, a
state-space layer's hidden state) for every slot. Which slot belongs to which working set is the engine's
business (``engine/state_slots.py``); this module only stores and moves bytes, as ``kv_cache.py`` does for pages.

Each slot ``s`` of ``slots`` has two entries: the live state at index ``s`` and its snapshot, the state from
before the fire now running, at ``slots + s`` (a fold of fewer rows than the fire ran restores it). One more
entry, ``2 * slots``, is scratch for passes that belong to no working set (the pass-cost measurement). With
``rows`` per-row states a slot also has ``rows`` entries after those, ``row_entry(s, i)``: the state after row i
of the fire now running (a fold of i + 1 rows copies it: engine/fold.py).
"""

from __future__ import annotations

import torch

StateShapes = dict[int, tuple[tuple[int, ...], ...]]  # layer index → the shape of each of its state tensors


class StateCache:
    def __init__(
        self, shapes: StateShapes, slots: int, dtype: torch.dtype = torch.float32, device="cpu", rows: int = 0
    ):
        self.slots = slots
        self.rows = rows  # per-row states a slot keeps (0: none)
        entries = 2 * slots + 1 + slots * rows
        self.layers: dict[int, list[torch.Tensor]] = {
            layer: [torch.zeros((entries, *shape), dtype=dtype, device=device) for shape in per_layer]
            for layer, per_layer in shapes.items()
        }

    @staticmethod
    def bytes_per_slot(shapes: StateShapes, dtype: torch.dtype = torch.float32) -> int:
        """One working set's state (its snapshot doubles it)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(elem * _numel(s) for per_layer in shapes.values() for s in per_layer)

    @property
    def scratch(self) -> int:
        return 2 * self.slots

    def snapshot_of(self, slot: int) -> int:
        return self.slots + slot

    def row_entry(self, slot: int, row: int) -> int:
        """The entry of the state after row ``row`` (< ``rows``) of ``slot``'s running fire."""
        assert 0 <= row < self.rows
        return 2 * self.slots + 1 + slot * self.rows + row

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for ts in self.layers.values() for t in ts)

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Entry ``src[i]`` → entry ``dst[i]`` in every layer."""
        if not src:
            return
        device = next(iter(self.layers.values()))[0].device if self.layers else "cpu"
        s = torch.tensor(src, dtype=torch.int64, device=device)
        d = torch.tensor(dst, dtype=torch.int64, device=device)
        for ts in self.layers.values():
            for t in ts:
                t[d] = t[s]

    def zero(self, entries: list[int]) -> None:
        for ts in self.layers.values():
            for t in ts:
                t[entries] = 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
