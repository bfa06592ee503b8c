"""GGUF architectures as data: for each ``general.architecture`` this runtime reads (llama, qwen2, qwen3,
gemma3), the family it becomes, its tensor names (GGUF → Hugging Face), what llama.cpp's converter did to the
weights (q/k rows permuted for ``llama`` only; 1 added to every norm weight of ``gemma3``) and the config
fields its metadata gives. An architecture outside :data:`ARCHITECTURES` is refused before any tensor is read.

llama.cpp hardcodes some of Gemma 3's recipe instead of writing it to the file (src/llama-model.cpp, its
``LLM_ARCH_GEMMA3`` hparams): every sixth layer global, the sliding layers' rope base 1e4, and the attention
scale 1/sqrt(head_dim) except for the 62-layer (27B) model's 1/sqrt(hidden/heads); they are read the same
way here. A Llama 3.x file carries its rope scaling as ``rope_freqs.weight`` (a divisor per frequency), which
becomes ``rope_scaling = {"rope_type": "freq_factors", "factors": [...]}`` (models/rope.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .checkpoint import CheckpointError, TokenizerInfo
from .config import ModelConfig, UnsupportedModelError

ROPE_FREQS = "rope_freqs.weight"
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's "sandwich": GGUF's ffn_norm is the MLP's input norm, post_attention_norm wraps the attention's output
_GEMMA3_BLOCK = {
    **_LLAMA_BLOCK,
    **_QK_NORM,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
Meta = Callable[[str, Any], Any]  # key under the architecture's prefix, default → value


@dataclass(frozen=True)
class GgufArch:
    family: str
    block_names: dict[str, str]
    permute_qk: bool = False  # llama.cpp's converter permuted q/k rows for its rope layout
    norm_shift: float = 0.0  # what the converter added to every norm weight (Gemma: 1, its 1 + w)
    fields: Callable[[Meta, dict[str, Any]], dict[str, Any]] = field(default=lambda get, base: {})

    def hf_name(self, gguf_name: str) -> str:
        """GGUF tensor name → Hugging Face parameter name."""
        if gguf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[gguf_name]
        m = _BLOCK.fullmatch(gguf_name)
        if not m or m.group(2) not in self.block_names:
            raise CheckpointError(f"unexpected GGUF tensor {gguf_name}")
        return f"model.layers.{m.group(1)}.{self.block_names[m.group(2)]}.{m.group(3)}"

    def is_norm(self, gguf_name: str) -> bool:
        return gguf_name.endswith("norm.weight")


def _gemma3_fields(get: Meta, base: dict[str, Any]) -> dict[str, Any]:
    layers = base["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # a per-layer list of "is sliding" flags, where a file writes one
        types = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:
        types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers)]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(key, None) is not None:
            raise UnsupportedModelError(f"Gemma 3 with {key} set is not supported")
    scalar = base["hidden_size"] / base["num_attention_heads"] if layers == 62 else base["head_dim"]
    return dict(
        sliding_window=int(get("attention.sliding_window", None) or 4096),
        layer_types=tuple(types),
        rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=float(scalar),
        hidden_activation="gelu_pytorch_tanh",
        norm_weight_offset=1.0,
        sandwich_norms=True,
        scale_embeddings=True,
        qk_norm=True,
    )


def _llama_fields(get: Meta, base: dict[str, Any]) -> dict[str, Any]:
    window = get("attention.sliding_window", None)  # Mistral, where the file carries it
    return {} if window is None else {"sliding_window": int(window)}


ARCHITECTURES: dict[str, GgufArch] = {
    "llama": GgufArch("llama", _LLAMA_BLOCK, permute_qk=True, fields=_llama_fields),
    "qwen2": GgufArch("qwen2", _LLAMA_BLOCK, fields=lambda get, base: {"attention_bias": True}),
    "qwen3": GgufArch("qwen3", {**_LLAMA_BLOCK, **_QK_NORM}, fields=lambda get, base: {"qk_norm": True}),
    "gemma3": GgufArch("gemma3", _GEMMA3_BLOCK, norm_shift=1.0, fields=_gemma3_fields),
}


def architecture(meta: dict[str, Any]) -> GgufArch:
    """The file's architecture, or UnsupportedModelError naming those supported."""
    arch = meta.get("general.architecture")
    spec = ARCHITECTURES.get(arch)  # type: ignore[arg-type]
    if spec is None:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    return spec


def config_from_metadata(
    meta: dict[str, Any],
    tensor_names: set[str],
    tokenizer: TokenizerInfo,
    rope_freqs: list[float] | None = None,
) -> ModelConfig:
    """The ModelConfig a GGUF's metadata describes. ``rope_freqs``: the values of its ``rope_freqs.weight``."""
    spec = architecture(meta)
    arch = meta["general.architecture"]
    missing = object()

    def get(key: str, default: Any = missing) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is missing:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", None) or hidden // heads)
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError("partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    rope_scaling = None
    kind = get("rope.scaling.type", None)
    if kind not in (None, "none"):
        if kind != "linear":
            raise UnsupportedModelError(f"unsupported GGUF rope scaling {kind!r}; supported: linear")
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if rope_freqs is not None:
        if rope_scaling is not None:
            raise UnsupportedModelError("a GGUF with both rope_freqs and rope scaling is not supported")
        rope_scaling = {"rope_type": "freq_factors", "factors": [float(f) for f in rope_freqs]}
    vocab = get("vocab_size", None) or len(meta["tokenizer.ggml.tokens"])
    base: dict[str, Any] = dict(
        family=spec.family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", None) or heads),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        # the GGUF stores eps as float32; round back to the decimal the original config had
        rms_norm_eps=float(f"{float(get('attention.layer_norm_rms_epsilon')):.6g}"),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(tokenizer.eos_token_ids),
    )
    base.update(spec.fields(get, base))
    return ModelConfig(**base)
