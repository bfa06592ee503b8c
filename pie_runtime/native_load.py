"""Builds a stored Llama-family or Gemma 3 model on the native step (models/native_model.py) straight from the store's
blocks: each tensor is read from the safetensors file when it is packed, so no float32 copy of the model exists
at any time (a float tensor is quantized here one tensor at a time).

    format  projections                                       lm head and embedding (tied: one table)
    int4    the stored Q4_0/Q4_1 blocks as they are;           the stored Q8_0 blocks as they are;
            float (or Q8_0) tensors quantized to Q4_1          float tensors quantized to Q8_0
    int8    Q8_0: stored Q8_0 as it is, others requantized

Norms and biases are float32; a norm of the form ``x * (1 + w)`` (Gemma) gets its 1 added here, so the step
multiplies by the weight alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .models.config import ModelConfig
from .models.native_linear import PackedWeight
from .models.native_model import NativeLayer, NativeLlama, unsupported
from .models.quant import GroupQuant
from .store import _BITS, _GROUP, _QUANT_PARTS, TOKENIZER_FILE, WEIGHTS_FILE, LoadedModel, ModelStore, StoreError

NATIVE_FORMATS = ("int4", "int8")


@dataclass
class _Stored:
    """One stored tensor: float, or the packed parts of a quantized one (kind, q, d, m)."""

    float_value: torch.Tensor | None = None
    kind: str = ""
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def dequantized(self) -> torch.Tensor:
        if self.float_value is not None:
            return self.float_value.float()
        assert self.parts is not None
        gq = GroupQuant.from_packed(*self.parts, bits=_BITS[self.kind], group=_GROUP, kind=self.kind)  # type: ignore[index]
        return gq.dequantize()


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
        q, d, m = (self._tensor(f"{name}{p}") for p in _QUANT_PARTS)
        return _Stored(kind=kind, parts=(q, d, m))

    def float32(self, name: str) -> torch.Tensor:
        # a copy, always: a tensor read from the file may map it, and one kept would keep the whole file mapped
        return self._tensor(name).detach().to(torch.float32, copy=True).contiguous()


def _pack(parts: list[_Stored], fmt: str) -> PackedWeight:
    """Parts stacked along output rows, packed for ``fmt``: their own blocks when they are all of the format's
    kind, else their float values quantized here."""
    kinds = {p.kind for p in parts}
    if fmt == "int4" and kinds <= {"q4_0", "q4_1"} and "" not in kinds:
        q, d, m = (torch.cat([p.parts[i] for p in parts]) for i in range(3))  # type: ignore[index]
        return PackedWeight.pack_q4(q, d, m)
    if kinds == {"q8_0"}:
        return PackedWeight.pack_q8(torch.cat([p.parts[0] for p in parts]), torch.cat([p.parts[1] for p in parts]))  # type: ignore[index]
    return PackedWeight.from_float(torch.cat([p.dequantized() for p in parts]), 4 if fmt == "int4" else 8)


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

    def close(self) -> None:
        self.file.close()


def load_native(name: str, fmt: str, store: ModelStore | None = None) -> LoadedModel:
    """The stored model ``name`` on the native step in ``fmt`` (int4 or int8), checked against its digests."""
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
    layers = [_layer(reader, cfg, i, fmt) for i in range(cfg.num_hidden_layers)]
    final_norm = _norm(reader, cfg, "model.norm.weight")
    embed = _pack([reader.get("model.embed_tokens.weight")], "int8")
    head = embed if cfg.tie_word_embeddings else _pack([reader.get("lm_head.weight")], "int8")
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
        qkv=_pack([reader.get(f"{n}.weight") for n in attn], fmt),
        o=_pack([reader.get(f"{at}self_attn.o_proj.weight")], fmt),
        gate_up=_pack([reader.get(f"{at}mlp.{p}_proj.weight") for p in ("gate", "up")], fmt),
        down=_pack([reader.get(f"{at}mlp.down_proj.weight")], fmt),
        ln1=norm("input_layernorm.weight"),
        ln2=norm("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"),
        qkv_bias=_bias(reader, [f"{n}.bias" for n in attn]),
        o_bias=_bias(reader, [f"{at}self_attn.o_proj.bias"]),
        q_norm=norm("self_attn.q_norm.weight") if cfg.qk_norm else None,
        k_norm=norm("self_attn.k_norm.weight") if cfg.qk_norm else None,
        attn_post_norm=norm("post_attention_layernorm.weight") if sandwich else None,
        ff_post_norm=norm("post_feedforward_layernorm.weight") if sandwich else None,
    )
