"""Prepares a loaded model for serving in one weight format: q/k/v and gate/up fused into one matmul each,
every projection turned into the format's linear layer, and batch-invariant attention wherever the
activations are bfloat16. fp32 is the reference and stays as loaded (unfused: fusing changes MKL's
float32 sums in the last bits, and fp32 is the format that matches transformers op for op).

    format  projections                         lm head                 activations, KV cache
    fp32    float32 (MKL), unfused              float32 (+ prepacked)   float32
    bf16    bfloat16 (oneDNN, AMX)              bfloat16                bfloat16
    int8    int8 weight-only, per channel       int8, per channel       bfloat16
    int4    int4 weight-only, groups of 32      int8, per channel       bfloat16

Norms accumulate and logits come out in float32 in every format. A GGUF's own blocks (Q4_0, Q4_1, Q8_0, kept
by the store) become the int4/int8 layers as they are; a float checkpoint is quantized here, at load.
 The lm head stays 8-bit in int4: several times faster than bf16's at 1 row, for a point or less of top-1 agreement
with fp32 on held-out text (docs/performance.md, "The int8 lm head of int4"). Batch invariance is what keeps greedy
speculation exact outside fp32: row i of a verify window gets the bits a 1-row pass gives it (models/attention_math.py,
``attend_invariant``); the int matmuls are invariant by themselves, bf16's once every matmul has one shape
(``Linear.invariant_rows``: slices of 16 rows, the last padded; oneDNN sums a partial tile's rows, a single row, and
on AMX the lm head at 33-300 rows, in other orders), fp32's MKL ones are not (fp32's differences are ~1e-7, below
what flips an argmax in practice). On an x86 CPU without bf16 units the slices are single rows (:func:`bf16_rows`).
"""

from __future__ import annotations

import platform
from typing import TypeVar, cast

import torch
from torch import nn

from .families import CausalLM
from .formats import WEIGHT_FORMATS
from .linear import Linear
from .llama import DecoderLayer, LlamaForCausalLM
from .quant import GroupQuant, Int4Linear, Int8Linear, quantize_int4, quantize_int8

INT4_GROUP = 32  # inputs per int4 scale and zero (GGUF's Q4 block)
DrafterModule = TypeVar("DrafterModule", bound=nn.Module)
BF16_ROWS = 16  # rows per matmul of a bf16 layer (Linear.invariant_rows) with bf16 units: one shape, whatever the pass
# activations and KV cache of each format
ACTIVATION_DTYPE: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "int8": torch.bfloat16,
    "int4": torch.bfloat16,
    "gguf": torch.bfloat16,  # on torch's kernels gguf is served as int4 (its own kinds run on the native step)
}


def bf16_rows(device: torch.device) -> int:
    """Rows per matmul of a bf16 layer on ``device``. An x86 CPU without bf16 units (no AVX512-BF16, no AMX)
    gets 1: oneDNN's bf16 kernels there cost the same per row alone or in a tile, so 16-row slices made a
    1-row decode pass pay for 16 (docs/performance.md, "bf16 on an x86 CPU without bf16 units"). Elsewhere a
    tile costs little more than a row: ``BF16_ROWS``."""
    if device.type != "cpu" or platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return BF16_ROWS
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return BF16_ROWS if native else 1


def load_dtype(fmt: str) -> torch.dtype:
    """The dtype to load the float model in before :func:`prepare_for_serving`: quantized formats start from
    float32, so that what is quantized at load is the checkpoint's own values, not a bf16 rounding of them."""
    return torch.float32 if fmt in ("int8", "int4", "gguf") else ACTIVATION_DTYPE[fmt]


def prepare_for_serving(model: CausalLM, fmt: str, quantized: dict[str, GroupQuant] | None = None) -> CausalLM:
    """Fuses and converts ``model`` in place (inference only: it no longer loads a Hugging Face state dict).
    ``quantized``: the checkpoint's own quantized tensors by Hugging Face name (a GGUF's blocks). The families
    with recurrent state (Mamba, LFM2) are served in fp32 or bf16 (loaded in that dtype, unfused)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if fmt == "gguf":
        fmt = "int4"  # torch has no kernels for the K kinds: the stored Q4_0/Q4_1 as they are, the rest requantized
    if fmt == "fp32":
        return model  # the reference format stays as loaded: transformers' float32 math, op for op
    if not isinstance(model, LlamaForCausalLM):
        if fmt != "bf16":
            raise ValueError(f"{model.config.family} models are served in fp32 or bf16, not {fmt}")
        return model
    blocks = quantized or {}
    for i, layer in enumerate(cast(list[DecoderLayer], list(model.model.layers))):
        attn, mlp = layer.self_attn, layer.mlp
        at = f"model.layers.{i}."
        attn.qkv_proj = _layer(
            fmt,
            [attn.q_proj, attn.k_proj, attn.v_proj],
            [f"{at}self_attn.{p}_proj.weight" for p in "qkv"],
            blocks,
        )
        del attn.q_proj, attn.k_proj, attn.v_proj
        attn.o_proj = _layer(fmt, [attn.o_proj], [f"{at}self_attn.o_proj.weight"], blocks)
        mlp.gate_up_proj = _layer(
            fmt, [mlp.gate_proj, mlp.up_proj], [f"{at}mlp.gate_proj.weight", f"{at}mlp.up_proj.weight"], blocks
        )
        del mlp.gate_proj, mlp.up_proj
        mlp.down_proj = _layer(fmt, [mlp.down_proj], [f"{at}mlp.down_proj.weight"], blocks)
        attn.batch_invariant = True
    if fmt in ("int8", "int4"):
        head = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
        gq = blocks.get(head)
        if gq is None or gq.bits != 8:
            gq = quantize_int8(model.lm_head.weight.detach().float())
        model.lm_head = Int8Linear(gq, None, model.lm_head.weight.device)  # type: ignore[assignment]  # the untied head's float copy goes with it
    elif fmt == "bf16":
        model.lm_head.invariant_rows = bf16_rows(model.lm_head.weight.device)
    model.to(ACTIVATION_DTYPE[fmt])  # what is left in float: the embedding table, norms, biases
    return model


def serve_drafter(module: DrafterModule, fmt: str, native: bool = False) -> DrafterModule:
    """A drafter module (an MTP or EAGLE head) beside a target served in ``fmt``, in place: in int8 and int4
    every projection becomes an int8 layer, one by one (unfused); fp32 and bf16 keep it as loaded. A draft step
    at one row reads its weights once, so its cost follows their bytes: int8 makes the default model's MTP step
    several times cheaper than bf16. Not int4 beside an int4 target: at this size it is no faster than int8,
    and a few layers carry their rounding straight to the drafts (a 4-layer draft model does not survive int4
    at all; README); the MTP head's first-draft agreement in int8 stays near bf16's (docs/performance.md,
    "Drafter heads beside an int8/int4 target").
    Exactness does not depend on it: verification keeps only what the target chooses. Beside a target on the
    native step (``native``: float32 hidden states) the projections become the native 8-bit layers instead
    (Q8_0, :class:`~.native_linear.PackedLinear`), float32 in and out."""
    if fmt not in ("int8", "int4", "gguf"):
        return module
    if native:
        from .native_linear import PackedLinear, PackedWeight

        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    packed = PackedWeight.from_float(child.weight.detach(), 8)
                    setattr(parent, name, PackedLinear(packed, None if child.bias is None else child.bias.detach()))
        return module
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, _layer("int8", [child], [name], {}))
    return module


def _layer(fmt: str, parts: list[nn.Module], names: list[str], blocks: dict[str, GroupQuant]) -> nn.Module:
    """One layer computing ``parts`` side by side (their output rows concatenated) in format ``fmt``."""
    weights = [p.weight.detach() for p in parts]  # type: ignore[union-attr]
    biases = [p.bias for p in parts]  # type: ignore[union-attr]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])  # type: ignore[union-attr]
    if fmt == "bf16":
        fused = Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=bias is not None)
        fused.weight = nn.Parameter(torch.cat(weights).to(ACTIVATION_DTYPE[fmt]), requires_grad=False)
        if bias is not None:
            fused.bias = nn.Parameter(bias.to(ACTIVATION_DTYPE[fmt]), requires_grad=False)
        fused.invariant_rows = bf16_rows(weights[0].device)
        return fused
    # int4 needs whole groups of 32 inputs; a layer without them (rare widths) runs int8
    bits = 4 if fmt == "int4" and weights[0].shape[1] % INT4_GROUP == 0 else 8
    own = [blocks.get(n) for n in names]
    if all(g is not None and g.bits == bits for g in own):
        gq = GroupQuant.cat([g for g in own if g is not None])
    else:
        w = torch.cat(weights).float()
        gq = quantize_int4(w, INT4_GROUP) if bits == 4 else quantize_int8(w)
    if bias is not None:
        bias = bias.to(torch.bfloat16)
    device = weights[0].device
    return Int4Linear(gq, bias, device) if bits == 4 else Int8Linear(gq, bias, device)


def linear_bytes(model: nn.Module) -> int:
    """Bytes of the projection and lm head weights as served (a tied float lm head counts with the embedding)."""
    total = 0
    for m in model.modules():
        if isinstance(m, Int4Linear | Int8Linear):
            total += m.weight_bytes
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total
