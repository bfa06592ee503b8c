"""Hugging Face transformers as the reference implementation, for parity tests and benchmarks only.

transformers is a test extra, never a runtime dependency: it is imported inside the functions.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .models.config import AnyConfig, ModelConfig


def transformers_llama(store_dir: Path, c: AnyConfig, scratch: Path):
    """transformers' LlamaForCausalLM over the weights a store entry holds, in float32: the weights file is
    linked into ``scratch`` beside a config.json written from ``c``, or, when the store keeps quantized blocks
    (a GGUF import), their float32 dequantization is written there (what the fp32 engine serves, bit for bit)."""
    import transformers

    write_llama_folder(store_dir, c, scratch)
    return transformers.LlamaForCausalLM.from_pretrained(scratch, dtype=torch.float32).eval()


def write_llama_folder(store_dir: Path, c: AnyConfig, scratch: Path, copy: bool = False) -> Path:
    """``scratch`` as a Hugging Face Llama checkpoint of the store entry (config.json and float32
    model.safetensors, see :func:`transformers_llama`); ``copy``: a copy of an unquantized weights file
    instead of a link (a folder another program reads after the store may change)."""
    import transformers

    if not isinstance(c, ModelConfig):
        raise ValueError(f"transformers_llama runs Llama-family models, not {c.family}")
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        # transformers 5 takes rope_theta through **kwargs, which its signature does not show
        rope_theta=c.rope_theta,  # pyright: ignore[reportCallIssue]
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids) or None,
    )
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "config.json").write_text(json.dumps(config.to_dict()))
    if not (scratch / "model.safetensors").exists():
        manifest = json.loads((store_dir / "manifest.json").read_text())
        if manifest.get("quantized"):
            from safetensors.torch import save_file

            from .store import ModelStore, load_model

            loaded = load_model(store_dir.name, store=ModelStore(store_dir.parent), keep_quantized=False)
            state = loaded.model.state_dict()
            if c.tie_word_embeddings:
                state.pop("lm_head.weight", None)
            save_file({k: v.contiguous() for k, v in state.items()}, scratch / "model.safetensors")
        elif copy:
            shutil.copy(store_dir / "model.safetensors", scratch / "model.safetensors")
        else:
            os.symlink(store_dir / "model.safetensors", scratch / "model.safetensors")
    return scratch


def greedy_continuation(hf_model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` for exactly ``n`` tokens (no EOS stop)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()
