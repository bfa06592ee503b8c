"""The Llama-family model config: one frozen pydantic model whose switches cover Llama 2/3, SmolLM2,
Mistral, Qwen2 (attention bias) and Qwen3 (q/k RMS norm)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Family = Literal["llama", "mistral", "qwen2", "qwen3"]
SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")


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

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict; refuses model types outside the family."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
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
        )
