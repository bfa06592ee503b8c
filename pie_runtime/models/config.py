"""Model configs, one frozen pydantic model per architecture: the Llama family (switches for Llama 2/3, SmolLM2,
Mistral, Qwen2's attention bias, Qwen3's q/k RMS norm and Gemma 3's recipe), Mamba (pure selective state-space
layers) and LFM2 (short-convolution and attention layers). :func:`config_from_hf` picks the one a config.json names.

Every config answers the engine's questions the same way: ``kv_layers`` (layers with a paged KV cache),
``num_key_value_heads`` and ``head_dim`` (their shape), ``recurrent`` (whether a sequence carries a state
besides its KV pages) and ``state_granule`` (the rows a state advances by: 1 for every family here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

Family = Literal["llama", "mistral", "qwen2", "qwen3", "gemma3"]
LLAMA_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
Activation = Literal["silu", "gelu_pytorch_tanh"]
SUPPORTED_FAMILIES: tuple[str, ...] = (*LLAMA_FAMILIES, "mamba", "lfm2")
HF_LLAMA_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text")


class UnsupportedModelError(ValueError):
    """The checkpoint's model type or architecture is not one this runtime implements."""


class LayerRecipe(BaseModel):
    """What one decoder layer of the Llama family computes, read from its config (the torch path's switches and
    the native step's per-layer table): its norms' placement and offset, activation, q/k norms, attention
    scale, rope table and window."""

    model_config = ConfigDict(frozen=True)

    sandwich_norms: bool
    norm_weight_offset: float
    activation: Activation
    qk_norm: bool
    attention_scale: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    window: int | None  # rows attended, the query's own included (None: every earlier row)


class ModelConfig(BaseModel):
    """Shapes and switches of a Llama-family decoder. Field names follow Hugging Face's config.json."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: Family = "llama"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2 always; Llama when set)
    o_proj_bias: bool = False  # bias on the output projection (Llama's attention_bias sets both)
    qk_norm: bool = False  # per-head RMS norm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention: a sliding layer's query at position p attends to keys at positions q with
    # p - q < sliding_window (its own row included: W rows at most), as Hugging Face and llama.cpp mask it.
    # ``layer_types`` names each layer; None with a window set means every layer slides (Mistral).
    sliding_window: int | None = Field(default=None, gt=0)
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] | None = None
    # Gemma 3's recipe (docs/models.md states each rule with its source); the defaults are the Llama family's.
    # MLP: down(act(gate(x)) * up(x)); "gelu_pytorch_tanh" is GELU with the tanh approximation (GeGLU)
    hidden_activation: Activation = "silu"
    # every RMS norm (layers, q/k, final) computes rms_normed(x) * (norm_weight_offset + w): Gemma stores w
    # with 1 + w applied (offset 1.0); the store keeps Hugging Face's w, whatever the source file held
    norm_weight_offset: float = 0.0
    # Gemma 2/3 "sandwich" norms: h = x + post_attention_layernorm(attn(input_layernorm(x))), then
    # out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))). Without it (Llama) the
    # post_attention_layernorm is the MLP's input norm and there is no pre/post_feedforward_layernorm
    sandwich_norms: bool = False
    # input embeddings multiplied by sqrt(hidden_size), that factor rounded to the activations' dtype first
    scale_embeddings: bool = False
    # attention scores scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)
    query_pre_attn_scalar: float | None = Field(default=None, gt=0)
    # rope base of the sliding layers (Gemma 3: 1e4); None: rope_theta on every layer. Where it is set, the
    # sliding layers use plain rope at this base and ``rope_theta`` / ``rope_scaling`` are the full layers' only
    rope_local_base_freq: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError("layer_types needs one entry per layer")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("sliding_attention layers need a sliding_window")
        return self

    def attention_window(self, layer: int) -> int | None:
        """Rows layer ``layer`` attends to (its own included), or None where it attends to every earlier row.
        The one place every path (torch, native step, KV page groups) asks which layers slide."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def attention_scale(self) -> float:
        """The factor on q.k before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_kind(self, layer: int) -> Literal["global", "local"]:
        """ "local" on a sliding layer of a model that names a local rope base (Gemma 3), else "global"."""
        local = self.rope_local_base_freq is not None and self.attention_window(layer) is not None
        return "local" if local else "global"

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(rope base, rope_scaling) of layer ``layer``: the local base without scaling on a "local" layer,
        else the model's."""
        if self.rope_kind(layer) == "local":
            return cast(float, self.rope_local_base_freq), None
        return self.rope_theta, self.rope_scaling

    def layer_recipe(self, layer: int) -> LayerRecipe:
        theta, scaling = self.layer_rope(layer)
        return LayerRecipe(
            sandwich_norms=self.sandwich_norms,
            norm_weight_offset=self.norm_weight_offset,
            activation=self.hidden_activation,
            qk_norm=self.qk_norm,
            attention_scale=self.attention_scale,
            rope_theta=theta,
            rope_scaling=scaling,
            window=self.attention_window(layer),
        )

    @property
    def embed_scale(self) -> float:
        """What the input embeddings are multiplied by (round it to the activations' dtype before use)."""
        return self.hidden_size**0.5 if self.scale_embeddings else 1.0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_layers(self) -> int:
        return self.num_hidden_layers

    recurrent: ClassVar[bool] = False
    state_granule: ClassVar[int] = 1

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict; refuses model types outside the family."""
        model_type = hf.get("model_type")
        if model_type == "gemma3":  # the multimodal config: its text part is a gemma3_text config
            hf = {"model_type": "gemma3_text", **hf.get("text_config", {})}
            model_type = "gemma3_text"
        if model_type not in HF_LLAMA_TYPES:
            supported = ", ".join(HF_LLAMA_TYPES)
            raise UnsupportedModelError(f"unsupported model_type {model_type!r}; supported: {supported}")
        heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _rope_from_hf(hf.get("rope_parameters"), hf)
        fields: dict[str, Any] = dict(
            family="gemma3" if model_type == "gemma3_text" else model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            o_proj_bias=model_type != "qwen2" and bool(hf.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf),
            **_window_from_hf(model_type, hf),
        )
        if model_type == "gemma3_text":
            fields.update(_gemma3_from_hf(hf))
        return cls(**fields)


def _rope_from_hf(params: Any, hf: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a config's ``rope_theta`` / ``rope_scaling`` or transformers >= 5's
    ``rope_parameters`` (one dict, or one per layer type, whose full-attention entry this reads)."""
    rope_theta = hf.get("rope_theta")
    rope_scaling = hf.get("rope_scaling")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if isinstance(params, dict):
        rope_theta = rope_theta or params.get("rope_theta")
        if params.get("rope_type", "default") != "default":
            rope_scaling = rope_scaling or params
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        rope_scaling = None
    return rope_theta, rope_scaling


def _window_from_hf(model_type: str, hf: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as transformers reads them: Mistral slides every layer where a
    window is set; Qwen2/Qwen3 only with ``use_sliding_window``, on layers from ``max_window_layers`` on;
    Gemma 3 every ``sliding_window_pattern``-th layer global (6) unless ``layer_types`` names each; Llama never."""
    window = hf.get("sliding_window", 4096 if model_type == "gemma3_text" else None)
    types = hf.get("layer_types")
    if model_type == "llama" or window is None:
        return {}
    if model_type in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window", False):
            return {}
        first = hf.get("max_window_layers", hf["num_hidden_layers"])
        types = types or [
            "sliding_attention" if i >= first else "full_attention" for i in range(hf["num_hidden_layers"])
        ]
    elif model_type == "gemma3_text" and types is None:
        pattern = hf.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(hf["num_hidden_layers"])]
    return {"sliding_window": int(window), "layer_types": None if types is None else tuple(types)}


def _gemma3_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's recipe fields (Hugging Face's Gemma3TextConfig defaults where the file omits one)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise UnsupportedModelError(f"Gemma 3 with {key} set is not supported (no released checkpoint sets it)")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention is not supported (an encoder)")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "silu"):
        raise UnsupportedModelError(f"unsupported Gemma 3 activation {act!r}; supported: gelu_pytorch_tanh")
    params = hf.get("rope_parameters")
    local = hf.get("rope_local_base_freq")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        sliding = params["sliding_attention"]
        if sliding.get("rope_type", "default") != "default":
            raise UnsupportedModelError("Gemma 3 with rope scaling on its sliding layers is not supported")
        local = local or sliding.get("rope_theta")
    rope_theta, _ = _rope_from_hf(params, hf)
    heads = hf["num_attention_heads"]
    return dict(
        head_dim=hf.get("head_dim") or 256,
        rope_theta=rope_theta or 1_000_000.0,
        rope_local_base_freq=float(local or 10_000.0),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        max_position_embeddings=hf.get("max_position_embeddings", 131_072),
        hidden_activation=act,
        norm_weight_offset=1.0,
        sandwich_norms=True,
        scale_embeddings=True,
        qk_norm=True,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
    )


def _eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


class _RecurrentConfig(BaseModel):
    """What every family with recurrent state shares: its sizes, tied embeddings, special tokens, and a state
    that advances one row at a time."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    recurrent: ClassVar[bool] = True
    state_granule: ClassVar[int] = 1


class MambaConfig(_RecurrentConfig):
    """Mamba (Gu & Dao 2023): ``num_hidden_layers`` selective state-space blocks, no attention. Field names
    follow Hugging Face's MambaConfig; ``intermediate_size`` is ``expand * hidden_size``."""

    family: Literal["mamba"] = "mamba"
    state_size: int = Field(gt=0)
    conv_kernel: int = Field(gt=1)
    time_step_rank: int = Field(gt=0)
    use_bias: bool = False
    use_conv_bias: bool = True
    layer_norm_epsilon: float = 1e-5
    # a state-space model has no position limit; this bounds a working set like any model's context
    max_position_embeddings: int = Field(default=1 << 16, gt=0)

    kv_layers: ClassVar[int] = 0
    num_key_value_heads: ClassVar[int] = 1
    head_dim: ClassVar[int] = 1

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MambaConfig:
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported Mamba activation {hf.get('hidden_act')!r}; supported: silu")
        hidden = hf["hidden_size"]
        rank = hf.get("time_step_rank", "auto")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf.get("intermediate_size") or hf.get("expand", 2) * hidden,
            state_size=hf.get("state_size", 16),
            num_hidden_layers=hf["num_hidden_layers"],
            conv_kernel=hf.get("conv_kernel", 4),
            time_step_rank=-(-hidden // 16) if rank == "auto" else int(rank),
            use_bias=bool(hf.get("use_bias", False)),
            use_conv_bias=bool(hf.get("use_conv_bias", True)),
            layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf),
        )


class Lfm2Config(_RecurrentConfig):
    """LFM2 (Liquid AI): gated short-convolution layers and grouped-query attention layers (q/k RMS norm,
    RoPE), each followed by a SwiGLU MLP. ``layer_types`` names each layer "conv" or "full_attention";
    ``intermediate_size`` is the MLP width after Hugging Face's ``block_auto_adjust_ff_dim`` rule."""

    family: Literal["lfm2"] = "lfm2"
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    layer_types: tuple[Literal["conv", "full_attention"], ...]
    conv_L_cache: int = Field(gt=1)
    conv_bias: bool = False
    max_position_embeddings: int = Field(gt=0)
    norm_eps: float = 1e-5
    rope_theta: float = 1e6
    rope_scaling: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> Lfm2Config:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types needs one entry per layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self

    @property
    def kv_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Lfm2Config:
        n = hf["num_hidden_layers"]
        types = hf.get("layer_types")
        if types is None:
            attn = hf.get("full_attn_idxs") or list(range(n))
            types = ["full_attention" if i in attn else "conv" for i in range(n)]
        ff = hf.get("block_ff_dim") or hf["intermediate_size"]
        if hf.get("block_auto_adjust_ff_dim", True):  # Hugging Face's Lfm2MLP sizing, step by step
            ff = int(2 * ff / 3)
            mult = hf.get("block_ffn_dim_multiplier", 1.0)
            if mult is not None:
                of = hf.get("block_multiple_of", 256)
                ff = of * ((int(mult * ff) + of - 1) // of)
        params = hf.get("rope_parameters") or {}
        if params.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"unsupported LFM2 rope type {params.get('rope_type')!r}")
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=ff,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            layer_types=tuple(cast(list[Literal["conv", "full_attention"]], types)),
            conv_L_cache=hf.get("conv_L_cache", 3),
            conv_bias=bool(hf.get("conv_bias", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 128_000),
            norm_eps=hf.get("norm_eps", 1e-5),
            rope_theta=params.get("rope_theta") or hf.get("rope_theta") or 1e6,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", hf.get("tie_embedding", True))),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf),
        )


AnyConfig = ModelConfig | MambaConfig | Lfm2Config


# Hugging Face ``model_type`` → the config that reads its config.json (gemma3: its text_config)
HF_MODEL_TYPES: dict[str, Callable[[dict[str, Any]], AnyConfig]] = {
    **dict.fromkeys(HF_LLAMA_TYPES, ModelConfig.from_hf),
    "mamba": MambaConfig.from_hf,
    "lfm2": Lfm2Config.from_hf,
}


def config_from_hf(hf: dict[str, Any]) -> AnyConfig:
    """The config a Hugging Face config.json describes; refuses a model type this runtime does not implement."""
    build = HF_MODEL_TYPES.get(hf.get("model_type"))  # type: ignore[arg-type]
    if build is None:
        raise UnsupportedModelError(
            f"unsupported model_type {hf.get('model_type')!r}; supported: {', '.join(HF_MODEL_TYPES)}"
        )
    return build(hf)
