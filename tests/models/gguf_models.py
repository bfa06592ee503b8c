"""Tiny random-weight checkpoints of each GGUF architecture (llama with Llama 3's rope scaling, qwen2, qwen3,
gemma3), written from a transformers model the way llama.cpp's converter writes them (q/k rows permuted for
``llama`` only, 1 added to Gemma's norm weights, Llama 3's scaling as ``rope_freqs.weight``), with a byte-level
BPE vocabulary in the metadata: the model and its GGUF hold the same weights, so their logits must agree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB = 300
WINDOW = 8  # Gemma 3's sliding window here: a 40-token prompt runs far past it
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so that the tiny head's frequencies fall on all three sides
}
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=256,
    eos_token_id=257,
)


def hf_model(arch: str, seed: int = 0):
    """A transformers model of ``arch`` with random weights (norm weights near their neutral value)."""
    import transformers

    if arch == "llama":
        scaling = {**LLAMA3_SCALING, "rope_theta": 5e5}
        cfg = transformers.LlamaConfig(
            **_COMMON, num_hidden_layers=2, rope_parameters=scaling, tie_word_embeddings=False
        )
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**_COMMON, num_hidden_layers=2, rope_theta=1e6, tie_word_embeddings=True)  # pyright: ignore[reportCallIssue]
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**_COMMON, num_hidden_layers=2, rope_theta=1e6, tie_word_embeddings=True)  # pyright: ignore[reportCallIssue]
    elif arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **_COMMON, num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=16, tie_word_embeddings=True
        )
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    neutral = 0.0 if arch == "gemma3" else 1.0  # Gemma's norms multiply by 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(neutral + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k permutation (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}


def gguf_name(arch: str, hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = dict(_NAMES)
    if arch == "gemma3":
        names |= {
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
        }
    else:
        names["post_attention_layernorm"] = "ffn_norm"
    return f"blk.{layer}.{names[module]}.{kind}"


def write_gguf(model, arch: str, path: Path) -> Path:
    """``model``'s weights as llama.cpp's converter would write them, F32, with a byte-level BPE vocabulary."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters["full_attention"] if arch == "gemma3" else cfg.rope_parameters
    theta = rope["rope_theta"]
    w.add_rope_freq_base(theta)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    tokens = sorted(ByteLevel.alphabet()) + ["<|im_start|>", "<|im_end|>"]
    tokens += [f"<extra_{i}>" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * (VOCAB - 256))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    if arch == "llama":  # Llama 3's scaling as the converter writes it: a divisor per frequency
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        base = 1.0 / (theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        w.add_tensor("rope_freqs.weight", (base / scaled.double()).float().numpy())
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            a = _permute(a, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            a = _permute(a, cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + np.float32(1.0)
        w.add_tensor(gguf_name(arch, name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
