"""The Llama family and Gemma 3 on the native decoder step (``kernels/native/step.c``): the int4 and int8 weight
formats on x86 CPUs, one native call per forward pass instead of some sixty torch ops a layer. The families share
the step's stages; what differs is each layer's recipe, read from the config (:func:`layer_recipes`): its norms
(pre-norm, or Gemma's sandwich; a ``1 + w`` form folded into the weights at load), its MLP's activation, its q/k
norms, its rope table, its attention window; and the model's attention scale and embedding scale.

The model answers what the engine asks of a served model (``embed`` → ``forward`` → ``logits``, ``config``,
``rotary``, ``lm_head``, ``model.norm``), so the runner, the MTP and EAGLE heads and the samplers use it as they
use :class:`~.llama.LlamaForCausalLM`; hidden states and logits are float32. Its weights are the store's own
blocks repacked (:mod:`.native_linear`), its K/V live in the engine's pool (bfloat16), and its attention reads
them in place through the page tables of the pass's segments: a row sees the sequence indices below its own (a
tree window's row: those before the window, then its ancestors), whatever positions rope gave them, and a sliding
layer only those of its window (:mod:`.native_pass`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from . import native_lib
from .config import ModelConfig
from .context import ForwardContext
from .kv_cache import KVCache
from .llama import RMSNorm
from .native_abi import ACTIVATIONS, PassLayout, PieLayer, PieModel, PiePass, check_layouts
from .native_linear import PackedLinear, PackedWeight
from .native_pass import PassArrays, score_fields
from .rope import Rotary, inverse_frequencies

_PP = ctypes.POINTER(ctypes.c_void_p)
HEAD_DIMS = (64, 128, 256)  # what kernels/native/attention.h specialises


def unsupported(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot run on the native step, or None."""
    if cfg.head_dim not in HEAD_DIMS:
        return f"head_dim {cfg.head_dim} is not one of {', '.join(map(str, HEAD_DIMS))}"
    for name, k in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size)):
        if k % 32:
            return f"{name} {k} is not a multiple of 32"
    if cfg.q_size % 32:
        return f"the attention width {cfg.q_size} is not a multiple of 32"
    if cfg.hidden_activation not in ACTIVATIONS:
        return f"the activation {cfg.hidden_activation} is not one of {', '.join(ACTIVATIONS)}"
    return None


@dataclass
class NativeLayer:
    """One decoder layer's weights: the fused projections, packed, and the float32 norms (a ``1 + w`` form folded
    in) and biases. ``ln1`` is the attention's input norm, ``ln2`` the MLP's; the post norms are Gemma's
    sandwich norms on each block's output."""

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
    attn_post_norm: torch.Tensor | None = None
    ff_post_norm: torch.Tensor | None = None


def _pass_layouts(kv: KVCache) -> tuple[list[tuple[int, int | None]], list[int]]:
    """The pass layouts a step reads, one per (KV page group, window) of some layer (models/kv_groups.py), and
    each layer's: its group's page tables and write slots, at its window."""
    lay = kv.layout
    keys = list(dict.fromkeys(zip(lay.layer_group, lay.layer_window)))
    return keys, [keys.index(k) for k in zip(lay.layer_group, lay.layer_window)]


@dataclass(frozen=True)
class Recipe:
    """What a model's layers do beside their matmuls, in the step's terms: each layer's rope table and attention
    group (indices into ``ropes`` and ``windows``) and activation."""

    ropes: tuple[tuple[float, tuple | None], ...]  # (base, rope_scaling items) of each table
    windows: tuple[int | None, ...]  # each attention group's window (None: every earlier row)
    layer_rope: tuple[int, ...]
    layer_window: tuple[int, ...]
    act: int


def layer_recipes(cfg: ModelConfig) -> Recipe:
    """The step's per-layer recipe from the config's rules (``layer_rope``, ``attention_window``)."""
    ropes: list[tuple[float, tuple | None]] = []
    windows: list[int | None] = []
    layer_rope, layer_window = [], []
    for layer in range(cfg.num_hidden_layers):
        base, scaling = cfg.layer_rope(layer)
        rope = (base, None if scaling is None else tuple(sorted(scaling.items())))
        window = cfg.attention_window(layer)
        for table, item, at in ((ropes, rope, layer_rope), (windows, window, layer_window)):
            if item not in table:
                table.append(item)  # type: ignore[arg-type]
            at.append(table.index(item))  # type: ignore[arg-type]
    act = ACTIVATIONS[cfg.hidden_activation]
    return Recipe(tuple(ropes), tuple(windows), tuple(layer_rope), tuple(layer_window), act)


class _Decoder(nn.Module):
    """What the heads read of the decoder: the final norm (``model.norm``)."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.norm = norm


def _ptr_array(tensors: list[torch.Tensor | None]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[0 if t is None else t.data_ptr() for t in tensors])


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


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
        lib = native_lib.library()
        if lib is None:
            raise RuntimeError(f"the native kernels are not available ({native_lib.unavailable_reason()})")
        check_layouts(lib)
        self.config = cfg
        self.layers = layers
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norm.weight = nn.Parameter(final_norm.float().contiguous(), requires_grad=False)
        self.model = _Decoder(norm)
        self.embed_weight = embed
        self.lm_head = PackedLinear(lm_head)
        self.rotary = Rotary(cfg)
        self.recipe = layer_recipes(cfg)
        tables = [cfg.model_copy(update={"rope_theta": b, "rope_scaling": s and dict(s)}) for b, s in self.recipe.ropes]
        self._inv_freq = torch.stack([inverse_frequencies(t).float() for t in tables]).contiguous()
        self._embed_scale = torch.tensor(cfg.embed_scale, dtype=torch.float32)  # the activations' dtype
        kinds = [[w.kind for w in (x.qkv, x.o, x.gate_up, x.down)] for x in layers]
        self._kinds = torch.tensor(kinds, dtype=torch.int32)
        self._descriptor_for: tuple[KVCache, PieModel, list] | None = None  # the last pool's, with its pointees
        self._scratch = torch.empty(0, dtype=torch.uint8)

    @property
    def weight_bytes(self) -> int:
        packed = sum(w.nbytes for x in self.layers for w in (x.qkv, x.o, x.gate_up, x.down))
        shared = self.embed_weight is self.lm_head.packed
        return packed + self.lm_head.packed.nbytes + (0 if shared else self.embed_weight.nbytes)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(N,) ids → (N, H) float32 rows of the embedding table (times the model's embedding scale)."""
        rows = self.embed_weight.rows(token_ids.reshape(-1)).reshape(*token_ids.shape, self.config.hidden_size)
        return rows * self._embed_scale if self.config.embed_scale != 1.0 else rows

    def _layer_structs(self, kv: KVCache) -> ctypes.Array:
        r, slots = self.recipe, kv.k.shape[2]
        _, layer_layout = _pass_layouts(kv)
        return (PieLayer * len(self.layers))(
            *[
                PieLayer(
                    attn_norm=_ptr(x.ln1),
                    attn_post_norm=_ptr(x.attn_post_norm),
                    ff_norm=_ptr(x.ln2),
                    ff_post_norm=_ptr(x.ff_post_norm),
                    q_norm=_ptr(x.q_norm),
                    k_norm=_ptr(x.k_norm),
                    kv_slots=slots,
                    act=r.act,
                    rope=r.layer_rope[i],
                    layout=layer_layout[i],
                )
                for i, x in enumerate(self.layers)
            ]
        )

    def _descriptor(self, kv: KVCache) -> PieModel:
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

        m = PieModel(
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            inter=cfg.intermediate_size,
            kv_bf16=int(kv.k.dtype == torch.bfloat16),
            n_ropes=len(self.recipe.ropes),
            eps=cfg.rms_norm_eps,
            attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
        )
        for i, name in enumerate(("qkv", "o", "gate_up", "down")):
            m.w[i] = ctypes.cast(keep_ptrs([getattr(x, name).data for x in layers]), _PP)
        fields = {
            "qkv_bias": [x.qkv_bias for x in layers],
            "o_bias": [x.o_bias for x in layers],
            "k_cache": [kv.layer(i)[0] for i in range(cfg.num_hidden_layers)],  # its page group's storage
            "v_cache": [kv.layer(i)[1] for i in range(cfg.num_hidden_layers)],
        }
        for name, ts in fields.items():
            a = arr(ts)
            setattr(m, name, ctypes.cast(a, _PP) if a is not None else None)
        recipes = self._layer_structs(kv)
        keep.append(recipes)
        m.layer = ctypes.addressof(recipes)
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
        positions = ctx.positions.to(torch.int32).contiguous()
        at = positions.numpy()
        arrays = []
        keys, layer_layout = _pass_layouts(kv)
        for i, (group, window) in enumerate(keys):
            slots = ctx.view(layer_layout.index(i)).write_slots.numpy()
            whole = PassArrays.build(ctx.segments, n, kv.page_size, slots, group)
            arrays.append(whole if window is None else whole.windowed(ctx.segments, at, window))
        layouts = (PassLayout * len(arrays))(*[a.struct() for a in arrays])
        p = PiePass(
            n_rows=n,
            x=x.data_ptr(),
            out=out.data_ptr(),
            positions=positions.data_ptr(),
            layouts=ctypes.addressof(layouts),
            n_layouts=len(arrays),
        )
        keep = score_fields(p, ctx.scores)  # the arrays the pass points at, alive until the step returns
        need = lib.pie_step_scratch(ctypes.byref(model), n)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
        lib.pie_decoder_step(ctypes.byref(model), ctypes.byref(p), self._scratch.data_ptr())
        del keep, arrays
        return out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) final hidden states → (R, V) float32 logits."""
        return self.lm_head(hidden)
