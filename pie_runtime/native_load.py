"""Builds a stored Llama-family or Gemma 3 model on the native step (models/native_model.py) straight from the store's
blocks: each tensor is read from the safetensors file when it is packed, so no float32 copy of the model exists
at any time (a float tensor, or a block tensor a format cannot keep, is converted here one tensor at a time), and
a Q4_0/Q4_1/Q8_0 tensor kept as stored is read and packed a slice of rows at a time (a 262k-row embedding table
is never whole in memory but as the packed weight).

    format  projections                                       lm head and embedding (tied: one table)
    gguf    every tensor in its own stored kind (quant_kinds:  its own stored kind; a float table as Q8_0
            Q4_0/Q4_1 alone on the 4-bit kernel, Q8_0 alone
            on the 8-bit one, any other mix on WX); float
            tensors quantized to Q8_0
    int4    the stored Q4_0/Q4_1 blocks as they are;           the stored Q8_0 blocks as they are;
            Q8_0 as it is; anything else requantized to Q4_1   anything else requantized to Q8_0
    int8    Q8_0: stored Q8_0 as it is, others requantized

Norms and biases are float32; a norm of the form ``x * (1 + w)`` (Gemma) gets its 1 added here, so the step
multiplies by the weight alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .heap import release_freed
from .models.config import ModelConfig
from .models.native_linear import PackedWeight
from .models.native_model import NativeLayer, NativeLlama, unsupported
from .models.quant import GroupQuant
from .models.quant_kinds import BlockTensor
from .store import TOKENIZER_FILE, WEIGHTS_FILE, LoadedModel, ModelStore, StoreError, read_blocks

NATIVE_FORMATS = ("gguf", "int4", "int8")


@dataclass
class _Stored:
    """One stored tensor: float, or a quantized one's GGUF blocks."""

    float_value: torch.Tensor | None = None
    blocks: BlockTensor | None = None

    def dequantized(self) -> torch.Tensor:
        if self.float_value is not None:
            return self.float_value.float()
        assert self.blocks is not None
        return self.blocks.dequantize()


class _Reader:
    """Tensors by Hugging Face name, one at a time: from the store's safetensors file (``handle``, with the
    manifest's quantized names) or from a float state dict (``handle`` a dict)."""

    def __init__(self, handle, quantized: dict[str, str]):
        self.f = handle
        self.quantized = quantized
        self.names = set(handle) if isinstance(handle, dict) else set(handle.keys())
        self.names |= set(quantized)

    def _tensor(self, name: str) -> torch.Tensor:
        return self.f[name] if isinstance(self.f, dict) else self.f.get_tensor(name)

    def get(self, name: str) -> _Stored:
        kind = self.quantized.get(name)
        if kind is None:
            return _Stored(float_value=self._tensor(name))
        return _Stored(blocks=read_blocks(self._tensor, name, kind))

    def rows(self, name: str) -> int:
        """Rows of quantized tensor ``name`` (every stored part of it has one a row of the weight)."""
        kind = self.quantized[name]
        part = f"{name}.blocks" if f"{name}.blocks" in self.names else f"{name}.q"
        assert kind and part in self.names
        return int(self.f[part].shape[0]) if isinstance(self.f, dict) else self.f.rows(part)

    def blocks(self, name: str, r0: int, r1: int) -> BlockTensor:
        """Rows ``r0:r1`` of quantized tensor ``name`` as blocks, read alone (a large table is never whole twice)."""

        def part(stored: str) -> torch.Tensor:
            return self.f[stored][r0:r1] if isinstance(self.f, dict) else self.f.get_rows(stored, r0, r1)

        return read_blocks(part, name, self.quantized[name])

    def float32(self, name: str) -> torch.Tensor:
        # a copy, always: a tensor read from the file may map it, and one kept would keep the whole file mapped
        return self._tensor(name).detach().to(torch.float32, copy=True).contiguous()


def plan(kinds: list[str], fmt: str) -> str:
    """How parts of stored ``kinds`` ("" for float) fused into one weight run in ``fmt``: "q4" (the 4-bit kernel,
    blocks as stored), "q8" (the 8-bit one, as stored), "wx" (each part in its own kind), or "q4 requantized" /
    "q8 requantized" (from the float values, at load)."""
    kset = set(kinds)
    if fmt in ("gguf", "int4") and kset <= {"q4_0", "q4_1"}:
        return "q4"
    if kset == {"q8_0"}:
        return "q8"
    if fmt == "gguf" and kset != {""}:
        return "wx"
    return "q4 requantized" if fmt == "int4" else "q8 requantized"


def _pack(reader: _Reader, names: list[str], fmt: str) -> PackedWeight:
    """Tensors ``names`` stacked along output rows, packed for ``fmt`` as :func:`plan` says."""
    how = plan([reader.quantized.get(n, "") for n in names], fmt)
    if how in ("q4", "q8"):
        return _pack_stored(reader, names, how == "q4")
    parts = [reader.get(n) for n in names]
    blocks = [p.blocks for p in parts]
    if how == "wx":
        return PackedWeight.pack_blocks([b if b is not None else p.dequantized() for b, p in zip(blocks, parts)])
    return PackedWeight.from_float(torch.cat([p.dequantized() for p in parts]), 4 if fmt == "int4" else 8)


_PACK_ROWS = 8192  # rows of a stored Q4_0/Q4_1/Q8_0 tensor read and packed at a time (a multiple of 8)


def _pack_stored(reader: _Reader, names: list[str], q4: bool) -> PackedWeight:
    """Stored Q4_0/Q4_1 (``q4``) or Q8_0 tensors as they are, packed a slice of rows at a time into the weight's
    buffer: the load's transient is one slice, not the widened copies of a whole table (Gemma 3's is 167 MiB of
    int8 values alone). The kernel's layout keeps each group of 8 rows to itself, so slices starting at multiples
    of 8 pack to the same bytes as the whole; a fused weight whose parts do not all end at one is packed whole."""
    counts = [reader.rows(n) for n in names]
    if any(c % 8 for c in counts[:-1]):
        return _pack_group_quant(GroupQuant.cat([reader.get(n).blocks.group_quant() for n in names]), q4)  # type: ignore[misc, union-attr]
    slices = (
        _pack_group_quant(reader.blocks(n, r0, min(r0 + _PACK_ROWS, c)).group_quant(), q4)  # type: ignore[arg-type]
        for n, c in zip(names, counts)
        for r0 in range(0, c, _PACK_ROWS)
    )
    return PackedWeight.stacked(sum(counts), slices)


def _pack_group_quant(gq: GroupQuant, q4: bool) -> PackedWeight:
    if q4:
        return PackedWeight.pack_q4(gq.packed_q(), gq.d, gq.m)
    return PackedWeight.pack_q8(gq.q, gq.d.to(torch.float16))


WEIGHT_GROUPS = {  # what `pie model info` lists: the step's weights, by the Hugging Face names of their parts
    "q/k/v": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate/up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def describe(quantized: dict[str, str], layers: int, tied: bool, fmt: str) -> dict[str, str]:
    """Per group of tensors, the stored kinds of its layers and how ``fmt`` runs them, e.g. {"q/k/v": "24x
    q5_0+q5_0+q8_0 -> wx, 6x q4_k+q4_k+q6_k -> wx", ...}: what `pie model info` says."""
    out: dict[str, str] = {}
    for group, parts in WEIGHT_GROUPS.items():
        seen: dict[str, int] = {}
        for i in range(layers):
            kinds = [quantized.get(f"model.layers.{i}.{p}.weight", "") for p in parts]
            label = f"{'+'.join(k or 'float' for k in kinds)} -> {plan(kinds, fmt)}"
            seen[label] = seen.get(label, 0) + 1
        out[group] = ", ".join(f"{n}x {label}" for label, n in seen.items())
    table_fmt = "gguf" if fmt == "gguf" else "int8"
    for name, key in (("embedding", "model.embed_tokens.weight"), ("lm head", "lm_head.weight")):
        if name == "lm head" and tied:
            out[name] = "the embedding (tied)"
            continue
        kind = quantized.get(key, "")
        out[name] = f"{kind or 'float'} -> {plan([kind], table_fmt)}"
    return out


def _bias(reader: _Reader, names: list[str]) -> torch.Tensor | None:
    if not all(n in reader.names for n in names):
        return None
    return torch.cat([reader.float32(n) for n in names])


class _FileTensors:
    """The tensors of a safetensors file, each read into memory of its own when asked for. safetensors' own
    reader maps the whole file, and the mapping stays resident (in the process's RSS) until every tensor read
    from it is gone: reading tensor by tensor keeps the load's peak near what is kept."""

    _DTYPES = {
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "I32": torch.int32,
        "I64": torch.int64,
        "BOOL": torch.bool,
    }

    def __init__(self, path):
        import json

        self.file = open(path, "rb")  # noqa: SIM115 - closed by close(), after the last tensor
        size = int.from_bytes(self.file.read(8), "little")
        self.header = json.loads(self.file.read(size))
        self.header.pop("__metadata__", None)
        self.data_start = 8 + size

    def keys(self) -> list[str]:
        return list(self.header)

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        out = torch.empty(end - begin, dtype=torch.uint8)
        self.file.seek(self.data_start + begin)
        if self.file.readinto(out.numpy().data) != end - begin:
            raise StoreError(f"tensor {name} is cut short in {self.file.name}")
        return out.view(self._DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def rows(self, name: str) -> int:
        return int(self.header[name]["shape"][0])

    def get_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0:r1`` of tensor ``name`` (along its first dimension), read into memory of their own."""
        entry = self.header[name]
        shape = entry["shape"]
        begin, end = entry["data_offsets"]
        row = (end - begin) // max(shape[0], 1)
        out = torch.empty((r1 - r0) * row, dtype=torch.uint8)
        self.file.seek(self.data_start + begin + r0 * row)
        if self.file.readinto(out.numpy().data) != out.numel():
            raise StoreError(f"tensor {name} is cut short in {self.file.name}")
        return out.view(self._DTYPES[entry["dtype"]]).reshape([r1 - r0, *shape[1:]])

    def close(self) -> None:
        self.file.close()


def load_native(name: str, fmt: str, store: ModelStore | None = None) -> LoadedModel:
    """The stored model ``name`` on the native step in ``fmt`` (gguf, int4 or int8), checked against its digests."""
    if fmt not in NATIVE_FORMATS:
        raise ValueError(f"the native step serves {', '.join(NATIVE_FORMATS)}, not {fmt}")
    store = store or ModelStore()
    manifest = store.verify(name, use_cache=True)
    cfg = manifest.config
    if not isinstance(cfg, ModelConfig):
        family = manifest.family
        raise StoreError(f"model {name!r} is a {family} model: the native step runs the Llama family and Gemma 3")
    why = unsupported(cfg)
    if why is not None:
        raise StoreError(f"model {name!r} does not fit the native step: {why}")
    folder = store.path(name)
    f = _FileTensors(folder / WEIGHTS_FILE)
    try:
        model = _build(cfg, _Reader(f, dict(manifest.quantized)), fmt)
    finally:
        f.close()
    return LoadedModel(manifest=manifest, model=model, tokenizer_path=folder / TOKENIZER_FILE)  # type: ignore[arg-type]


def native_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor], fmt: str) -> NativeLlama:
    """A model on the native step from a float state dict with Hugging Face's names (the tests' random models)."""
    return _build(cfg, _Reader(state, {}), fmt)


def _build(cfg: ModelConfig, reader: _Reader, fmt: str) -> NativeLlama:
    layers = []
    for i in range(cfg.num_hidden_layers):
        layers.append(_layer(reader, cfg, i, fmt))
        release_freed()
    final_norm = _norm(reader, cfg, "model.norm.weight")
    table_fmt = "gguf" if fmt == "gguf" else "int8"
    embed = _pack(reader, ["model.embed_tokens.weight"], table_fmt)
    head = embed if cfg.tie_word_embeddings else _pack(reader, ["lm_head.weight"], table_fmt)
    release_freed()
    return NativeLlama(cfg, layers, final_norm, embed, head)


def _norm(reader: _Reader, cfg: ModelConfig, name: str) -> torch.Tensor:
    """An RMS norm's weight as the step multiplies by it: Hugging Face's ``w``, plus the config's offset (Gemma's
    ``x * (1 + w)``: 1 + w in float32, as transformers computes it)."""
    w = reader.float32(name)
    return w + cfg.norm_weight_offset if cfg.norm_weight_offset else w


def _layer(reader: _Reader, cfg: ModelConfig, i: int, fmt: str) -> NativeLayer:
    at = f"model.layers.{i}."
    attn = [f"{at}self_attn.{p}_proj" for p in "qkv"]
    sandwich = cfg.sandwich_norms  # Gemma: post_attention_layernorm is the attention's output norm

    def norm(name: str) -> torch.Tensor:
        return _norm(reader, cfg, at + name)

    return NativeLayer(
        qkv=_pack(reader, [f"{n}.weight" for n in attn], fmt),
        o=_pack(reader, [f"{at}self_attn.o_proj.weight"], fmt),
        gate_up=_pack(reader, [f"{at}mlp.{p}_proj.weight" for p in ("gate", "up")], fmt),
        down=_pack(reader, [f"{at}mlp.down_proj.weight"], fmt),
        ln1=norm("input_layernorm.weight"),
        ln2=norm("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"),
        qkv_bias=_bias(reader, [f"{n}.bias" for n in attn]),
        o_bias=_bias(reader, [f"{at}self_attn.o_proj.bias"]),
        q_norm=norm("self_attn.q_norm.weight") if cfg.qk_norm else None,
        k_norm=norm("self_attn.k_norm.weight") if cfg.qk_norm else None,
        attn_post_norm=norm("post_attention_layernorm.weight") if sandwich else None,
        ff_post_norm=norm("post_feedforward_layernorm.weight") if sandwich else None,
    )
