"""Model configs, one frozen pydantic model per architecture: the Llama family (switches for Llama 2/3, SmolLM2,
Mistral, Qwen2's attention bias and Qwen3's q/k RMS norm), Mamba (pure selective state-space layers) and LFM2
(short-convolution and attention layers). :func:`config_from_hf` picks the one a config.json names.

Every config answers the engine's questions the same way: ``kv_layers`` (layers with a paged KV cache),
``num_key_value_heads`` and ``head_dim`` (their shape), ``recurrent`` (whether a sequence carries a state
besides its KV pages) and ``state_granule`` (the rows a state advances by: 1 for every family here)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

Family = Literal["llama", "mistral", "qwen2", "qwen3"]
LLAMA_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_FAMILIES: tuple[str, ...] = (*LLAMA_FAMILIES, "mamba", "lfm2")


class UnsupportedModelError(ValueError):
    """The checkpoint's model type or architecture is not one this runtime implements."""


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
        if model_type not in LLAMA_FAMILIES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_theta = hf.get("rope_theta")
        rope_scaling = hf.get("rope_scaling")
        # transformers >= 5 folds rope_theta into rope_parameters
        params = hf.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or params
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return cls(
            family=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            o_proj_bias=model_type != "qwen2" and bool(hf.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            # Mistral's sliding window (every layer); other families' configs carry the key unused (Qwen2's
            # use_sliding_window defaults to off)
            sliding_window=hf.get("sliding_window") if model_type == "mistral" else None,
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


def config_from_hf(hf: dict[str, Any]) -> AnyConfig:
    """The config a Hugging Face config.json describes; refuses a model type this runtime does not implement."""
    model_type = hf.get("model_type")
    if model_type == "mamba":
        return MambaConfig.from_hf(hf)
    if model_type == "lfm2":
        return Lfm2Config.from_hf(hf)
    if model_type not in LLAMA_FAMILIES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return ModelConfig.from_hf(hf)
