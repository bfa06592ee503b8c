"""How an engine serves one model (the ``pie engine`` flags that shape it), checked on creation, and the
choices and defaults those flags offer. Torch-free, so the CLI reads the same names without importing torch;
``build.py`` builds a served model from them."""

from __future__ import annotations

from dataclasses import dataclass

RECURRENT_FOLDS = ("per-row", "replay")  # how a fold of fewer rows than ran brings the state back (engine/fold.py)
DEFAULT_STATE_SLOTS = 64  # working sets of a model with recurrent state at once (--state-slots)
DEFAULT_PER_ROW_STATES = 8  # per-row states a working set keeps under --recurrent-fold per-row (--per-row-states)
PASS_COST_CACHE_MODES = ("reuse", "refresh", "off")  # --pass-cost-cache (engine/pass_cost_cache.py)
DEFAULT_MAX_PROGRAMS = (
    256  # epilogue programs a client identity holds at once, LRU evicted (--max-programs; programs/registry.py)
)


@dataclass(frozen=True)
class ServeOptions:
    """``weights``: the weight format (models/weights.py); ``prepack_lm_head``: a oneDNN-prepacked copy of the
    lm head for multi-row readouts (CPU fp32 only; see models/linear.py); ``pass_cost_rows``: measure pass
    costs up to this many rows (0: don't), reusing a stored curve that still holds (``pass_cost_cache``: reuse,
    refresh or off; engine/pass_cost_cache.py); ``compiled``: torch.compile the decoder as one graph
    (models/compiled.py), and compile it before anyone is served; ``kv_pages``: the KV pool in pages (None:
    as many as ``kv_bytes`` hold); ``state_slots``: working sets a model with recurrent state holds at once
    (each a slot of its state and a snapshot; models without recurrent state ignore it);
    ``recurrent_fold``: ``per-row`` keeps the state after each of a speculative fire's first ``per_row_states``
    rows, so a fold of that many rows or fewer is a copy, or ``replay`` restores the snapshot and runs the kept
    rows again (engine/fold.py says why per-row is the default);
    ``tensor_parallel``: shard the model over that many ranks (``tp_worker.py``; float32 and the Llama family
    only, served without its MTP or EAGLE head, no prepacked or compiled copies); ``swa_full``: a sliding-window
    model's sliding layers keep every row instead of their window's pages (models/kv_groups.py)."""

    device: str = "cpu"
    weights: str = "fp32"  # a WeightFormat; prepare_for_serving refuses another
    page_size: int = 16
    kv_pages: int | None = None
    kv_bytes: int = 1 << 30
    prepack_lm_head: bool = True
    pass_cost_rows: int = 0
    pass_cost_cache: str = "reuse"
    compiled: bool = False
    state_slots: int = DEFAULT_STATE_SLOTS
    recurrent_fold: str = "per-row"
    per_row_states: int = DEFAULT_PER_ROW_STATES
    tensor_parallel: int = 1
    swa_full: bool = False  # sliding-window layers keep every row (one page group), as llama-server's --swa-full

    def __post_init__(self) -> None:
        """The checks that need no model: a ValueError in the words of the flag at fault."""
        if self.recurrent_fold not in RECURRENT_FOLDS:
            raise ValueError(f"--recurrent-fold is one of {', '.join(RECURRENT_FOLDS)}, not {self.recurrent_fold!r}")
        if self.per_row_states < 0:
            raise ValueError(f"--per-row-states must be 0 or more, not {self.per_row_states}")
        if self.sharded and self.weights != "fp32":
            raise ValueError(f"--tensor-parallel supports --weights fp32 only, not {self.weights}")
        if self.sharded and self.compiled:
            raise ValueError("--tensor-parallel does not combine with --compile")

    @property
    def sharded(self) -> bool:
        return self.tensor_parallel > 1

    @property
    def kept_row_states(self) -> int:
        """Per-row states a working set keeps (0 under ``replay``)."""
        return self.per_row_states if self.recurrent_fold == "per-row" else 0
