"""The Llama family on the native decoder step (``kernels/native/step.c``): the int4 and int8 weight formats on
x86 CPUs, one native call per forward pass instead of some sixty torch ops a layer.

The model answers what the engine asks of a served model (``embed`` → ``forward`` → ``logits``, ``config``,
``rotary``, ``lm_head``, ``model.norm``), so the runner, the MTP and EAGLE heads and the samplers use it as they
use :class:`~.llama.LlamaForCausalLM`; hidden states and logits are float32. Its weights are the store's own
blocks repacked (:mod:`.native_linear`), its K/V live in the engine's pool (bfloat16), and its attention reads
them in place through the page tables of the pass's segments: a row sees the sequence indices below its own (a
tree window's row: those before the window, then its ancestors), whatever positions rope gave them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import native_lib
from .attention_scores import PassScores
from .config import ModelConfig
from .context import ForwardContext, Segment, ancestor_mask
from .kv_cache import KVCache
from .llama import RMSNorm
from .native_linear import PackedLinear, PackedWeight
from .rope import Rotary

_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
HEAD_DIMS = (64, 128, 256)  # what kernels/native/attention.h specialises


class _PassLayout(ctypes.Structure):
    _fields_ = [
        ("row_seg", _P),
        ("row_limit", _P),
        ("row_extra", _P),
        ("extras", _P),
        ("seg_pages", _P),
        ("pages", _P),
        ("page_size", ctypes.c_int32),
        ("max_keys", ctypes.c_int32),
    ]


class _Pass(ctypes.Structure):
    _fields_ = [
        ("n_rows", ctypes.c_int64),
        ("x", _P),
        ("out", _P),
        ("positions", _P),
        ("write_slots", _P),
        ("layout", _PassLayout),
        ("n_scores", ctypes.c_int64),
        ("score_rows", _P),
        ("score_at", _P),
        ("score_width", _P),
        ("score_layered", _P),
        ("scores", _P),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("inter", ctypes.c_int32),
        ("qk_norm", ctypes.c_int32),
        ("kv_bf16", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("pad", ctypes.c_int32),
        ("kv_slots", ctypes.c_int64),
        ("w", _PP * 4),
        ("kinds", _P),
        ("qkv_bias", _PP),
        ("o_bias", _PP),
        ("ln1", _PP),
        ("ln2", _PP),
        ("q_norm", _PP),
        ("k_norm", _PP),
        ("final_norm", _P),
        ("inv_freq", _P),
        ("k_cache", _PP),
        ("v_cache", _PP),
    ]


def unsupported(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot run on the native step, or None."""
    if cfg.family == "gemma3" or cfg.sliding_window is not None:  # until the step takes a per-layer recipe
        return f"the native step runs neither {cfg.family}'s recipe nor sliding windows yet"
    if cfg.head_dim not in HEAD_DIMS:
        return f"head_dim {cfg.head_dim} is not one of {', '.join(map(str, HEAD_DIMS))}"
    for name, k in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size)):
        if k % 32:
            return f"{name} {k} is not a multiple of 32"
    if cfg.q_size % 32:
        return f"the attention width {cfg.q_size} is not a multiple of 32"
    if any(cfg.attention_window(i) is not None for i in range(cfg.num_hidden_layers)):
        return "sliding-window layers: the native step attends every row and reads one page table a segment"
    return None


@dataclass
class NativeLayer:
    """One decoder layer's weights: the fused projections, packed, and the float32 norms and biases."""

    qkv: PackedWeight
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class _Decoder(nn.Module):
    """What the heads read of the decoder: the final norm (``model.norm``)."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.norm = norm


def _ptr_array(tensors: list[torch.Tensor | None]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[0 if t is None else t.data_ptr() for t in tensors])


class NativeLlama(nn.Module):
    """``embed`` → ``forward`` (final hidden states, normed, float32) → ``logits`` on the rows read out, every
    pass one call of the native step."""

    attends_natively = True  # the runner need not lay out torch attention groups for its passes
    attention_scores = True  # a pass can read the attention mass out (the step's score rows)

    def __init__(
        self,
        cfg: ModelConfig,
        layers: list[NativeLayer],
        final_norm: torch.Tensor,
        embed: PackedWeight,
        lm_head: PackedWeight,
    ):
        super().__init__()
        if native_lib.library() is None:
            raise RuntimeError(f"the native kernels are not available ({native_lib.unavailable_reason()})")
        self.config = cfg
        self.layers = layers
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norm.weight = nn.Parameter(final_norm.float().contiguous(), requires_grad=False)
        self.model = _Decoder(norm)
        self.embed_weight = embed
        self.lm_head = PackedLinear(lm_head)
        self.rotary = Rotary(cfg)
        self._inv_freq = self.rotary.inv_freq.float().contiguous()
        kinds = [[w.kind for w in (x.qkv, x.o, x.gate_up, x.down)] for x in layers]
        self._kinds = torch.tensor(kinds, dtype=torch.int32)
        self._descriptor_for: tuple[KVCache, _Model, list] | None = None  # the last pool's, with what it points at
        self._scratch = torch.empty(0, dtype=torch.uint8)

    @property
    def weight_bytes(self) -> int:
        packed = sum(w.nbytes for x in self.layers for w in (x.qkv, x.o, x.gate_up, x.down))
        shared = self.embed_weight is self.lm_head.packed
        return packed + self.lm_head.packed.nbytes + (0 if shared else self.embed_weight.nbytes)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(N,) ids → (N, H) float32 rows of the embedding table."""
        return self.embed_weight.rows(token_ids.reshape(-1)).reshape(*token_ids.shape, self.config.hidden_size)

    def _descriptor(self, kv: KVCache) -> _Model:
        """The C model descriptor for the pool ``kv``, made when the pool changes (it holds the pool's pointers:
        the pool is kept alive with it)."""
        got = self._descriptor_for
        if got is not None and got[0] is kv:
            return got[1]
        cfg, layers = self.config, self.layers
        if kv.k.dtype not in (torch.bfloat16, torch.float32) or not kv.k.is_contiguous():
            raise ValueError(f"the native step reads a contiguous bfloat16 or float32 pool, not {kv.k.dtype}")
        keep: list = []

        def keep_ptrs(ts: list[torch.Tensor | None]) -> ctypes.Array:
            a = _ptr_array(ts)
            keep.append(a)
            return a

        def arr(ts: list[torch.Tensor | None]) -> ctypes.Array | None:
            return None if all(t is None for t in ts) else keep_ptrs(ts)

        m = _Model(
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            inter=cfg.intermediate_size,
            qk_norm=int(cfg.qk_norm),
            kv_bf16=int(kv.k.dtype == torch.bfloat16),
            eps=cfg.rms_norm_eps,
            kv_slots=kv.k.shape[2],
        )
        for i, name in enumerate(("qkv", "o", "gate_up", "down")):
            m.w[i] = ctypes.cast(keep_ptrs([getattr(x, name).data for x in layers]), _PP)
        fields = {
            "qkv_bias": [x.qkv_bias for x in layers],
            "o_bias": [x.o_bias for x in layers],
            "ln1": [x.ln1 for x in layers],
            "ln2": [x.ln2 for x in layers],
            "q_norm": [x.q_norm for x in layers],
            "k_norm": [x.k_norm for x in layers],
            "k_cache": [kv.k[i] for i in range(cfg.num_hidden_layers)],
            "v_cache": [kv.v[i] for i in range(cfg.num_hidden_layers)],
        }
        for name, ts in fields.items():
            a = arr(ts)
            setattr(m, name, ctypes.cast(a, _PP) if a is not None else None)
        m.kinds = self._kinds.data_ptr()
        m.final_norm = self.model.norm.weight.data_ptr()
        m.inv_freq = self._inv_freq.data_ptr()
        self._descriptor_for = (kv, m, keep)
        return m

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, ctx: ForwardContext, kv: KVCache, state: object = None) -> torch.Tensor:
        """hidden: (N, H) input embeddings → (N, H) float32 final hidden states after the last norm."""
        lib = native_lib.library()
        assert lib is not None  # checked at construction
        model = self._descriptor(kv)
        n = hidden.shape[0]
        x = hidden.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        layout = PassArrays.build(ctx.segments, n, kv.page_size)
        positions = ctx.positions.to(torch.int32).contiguous()
        slots = ctx.write_slots.to(torch.int64).contiguous()
        p = _Pass(
            n_rows=n,
            x=x.data_ptr(),
            out=out.data_ptr(),
            positions=positions.data_ptr(),
            write_slots=slots.data_ptr(),
            layout=layout.struct(),
        )
        keep = _score_fields(p, ctx.scores)  # the arrays the pass points at, alive until the step returns
        need = lib.pie_step_scratch(ctypes.byref(model), n)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
        lib.pie_decoder_step(ctypes.byref(model), ctypes.byref(p), self._scratch.data_ptr())
        del keep
        return out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) final hidden states → (R, V) float32 logits."""
        return self.lm_head(hidden)


def _score_fields(p: _Pass, scores: PassScores | None) -> list[np.ndarray]:
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


@dataclass
class PassArrays:
    """Where each row of a pass sits, as the C step reads it (attention.h's ``PassLayout``)."""

    row_seg: np.ndarray
    row_limit: np.ndarray
    row_extra: np.ndarray
    extras: np.ndarray
    seg_pages: np.ndarray
    pages: np.ndarray
    page_size: int
    max_keys: int

    @staticmethod
    def build(segments: tuple[Segment, ...], n_rows: int, page_size: int) -> PassArrays:
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
                rows = np.flatnonzero(anc[r]).astype(np.int32) + seg.window
                extras.append(rows)
            extra_counts.append(anc[first : first + seg.n_rows].sum(1).astype(np.int32))
        row_limit = np.concatenate(limits) if limits else np.zeros(0, np.int32)
        counts = np.concatenate(extra_counts) if extra_counts else np.zeros(0, np.int32)
        if len(row_limit) != n_rows:
            raise ValueError("the segments' rows do not add up to the pass's rows")
        tables = [np.asarray(seg.page_table, dtype=np.int32) for seg in segments]
        return PassArrays(
            row_seg=np.concatenate(seg_of).astype(np.int32) if seg_of else np.zeros(0, np.int32),
            row_limit=row_limit,
            row_extra=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            extras=np.concatenate(extras).astype(np.int32) if extras else np.zeros(1, np.int32),
            seg_pages=np.concatenate([[0], np.cumsum([len(t) for t in tables])]).astype(np.int32),
            pages=np.concatenate(tables).astype(np.int32) if tables else np.zeros(1, np.int32),
            page_size=page_size,
            max_keys=int((row_limit + counts).max()) if n_rows else 0,
        )

    def struct(self) -> _PassLayout:
        arrays = (self.row_seg, self.row_limit, self.row_extra, self.extras, self.seg_pages, self.pages)
        return _PassLayout(*(a.ctypes.data for a in arrays), self.page_size, self.max_keys)
