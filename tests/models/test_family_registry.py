"""The family registry and the config rules read from a Hugging Face config.json: which layers slide (Mistral,
Qwen2's use_sliding_window and max_window_layers, Gemma 3's pattern or layer_types), Gemma 3's rope per layer
kind and its refusals, and one lookup per family for everything the runtime asks of a model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pie_runtime.models.config import HF_MODEL_TYPES, UnsupportedModelError, config_from_hf
from pie_runtime.models.families import FAMILIES, build_causal_lm, embedding_weight, final_norm, norm_eps
from tests.models.tiny_models import ALL_FAMILIES, hf_config

COMMON: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def test_qwen2_window_only_with_use_sliding_window():
    import transformers

    off = transformers.Qwen2Config(**COMMON, use_sliding_window=False, sliding_window=16).to_dict()
    assert config_from_hf(off).sliding_window is None  # type: ignore[union-attr]
    on = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    cfg = config_from_hf(on.to_dict())
    assert [cfg.attention_window(i) for i in range(4)] == [None, None, 16, 16]  # type: ignore[union-attr]


def test_mistral_window_on_every_layer():
    import transformers

    cfg = config_from_hf(transformers.MistralConfig(**COMMON, sliding_window=16).to_dict())
    assert [cfg.attention_window(i) for i in range(4)] == [16] * 4  # type: ignore[union-attr]


def test_gemma3_pattern_rope_and_recipe_from_a_bare_config():
    """A config.json as old checkpoints wrote it: sliding_window_pattern, rope_theta and rope_local_base_freq."""
    hf = dict(
        COMMON,
        model_type="gemma3_text",
        num_hidden_layers=12,
        head_dim=16,
        sliding_window=32,
        sliding_window_pattern=6,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        query_pre_attn_scalar=20,
    )
    cfg = config_from_hf(hf)
    windows = [cfg.attention_window(i) for i in range(12)]  # type: ignore[union-attr]
    assert windows == ([32] * 5 + [None]) * 2
    assert cfg.layer_rope(0) == (1e4, None)  # type: ignore[union-attr]
    assert cfg.layer_rope(5) == (1e6, {"rope_type": "linear", "factor": 8.0})  # type: ignore[union-attr]
    recipe = cfg.layer_recipe(5)  # type: ignore[union-attr]
    assert recipe.sandwich_norms and recipe.norm_weight_offset == 1.0 and recipe.activation == "gelu_pytorch_tanh"
    assert recipe.attention_scale == 20**-0.5 and recipe.window is None and recipe.qk_norm
    multimodal = config_from_hf({"model_type": "gemma3", "text_config": hf})
    assert multimodal == cfg


@pytest.mark.parametrize("key", ["final_logit_softcapping", "attn_logit_softcapping"])
def test_gemma3_softcapping_is_refused(key):
    with pytest.raises(UnsupportedModelError, match=key):
        config_from_hf(dict(COMMON, model_type="gemma3_text", **{key: 30.0}))


def test_unknown_model_type_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="'gpt2'; supported: llama, mistral, qwen2, qwen3, gemma3"):
        config_from_hf({"model_type": "gpt2"})
    assert {"llama", "gemma3_text", "mamba", "lfm2"} <= set(HF_MODEL_TYPES)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_family_is_one_lookup(family):
    cfg = config_from_hf(hf_config(family).to_dict())
    assert cfg.family in FAMILIES
    model = build_causal_lm(cfg)
    assert embedding_weight(model).shape == (cfg.vocab_size, cfg.hidden_size)
    assert isinstance(final_norm(model), torch.nn.Module) and norm_eps(cfg) > 0
