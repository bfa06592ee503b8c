"""Convert a llama.cpp GGUF file (architecture ``llama``) into the store's layout: tensors under Hugging Face
names, a ModelConfig from the GGUF metadata, and a tokenizer.json rebuilt from the embedded vocabulary
(:mod:`.gguf_tokenizer`). Quantized weights of every kind in ``quant_kinds.KINDS`` are kept as their GGUF bytes
(``Converted.quantized``, a :class:`~.quant_kinds.BlockTensor` each, never requantized); float tensors become
float32; a file holding a kind outside the table is refused before any tensor is read.

Two traps: GGUF stores dims reversed (the reader already hands back row-major arrays in Hugging Face
order), and llama.cpp's converter permuted the q and k rows for its rope layout, which :func:`unpermute`
undoes (without it the logits are wrong although every shape fits).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .checkpoint import CheckpointError, Converted, TokenizerInfo, check_shapes
from .config import ModelConfig, UnsupportedModelError
from .gguf_meta import read_gguf
from .gguf_tokenizer import build_tokenizer, check_tokenizer
from .quant import QuantError
from .quant_kinds import BlockTensor, by_ggml_type, check_supported

SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
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
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name → Hugging Face parameter name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if not m or m.group(2) not in _BLOCK_NAMES:
        raise CheckpointError(f"unexpected GGUF tensor {gguf_name}")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs → Hugging Face's rotate-half halves)."""
    rows = w.shape[0]
    tail = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *tail).swapaxes(1, 2).reshape(w.shape)


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str], tokenizer: TokenizerInfo) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    if int(meta.get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError("partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    rope_scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise UnsupportedModelError(f"unsupported GGUF rope scaling {kind!r}")
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelConfig(
        family="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        # the GGUF stores eps as float32; round back to the decimal the original config had
        rms_norm_eps=float(f"{float(get('attention.layer_norm_rms_epsilon')):.6g}"),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(tokenizer.eos_token_ids),
    )


def convert_gguf(path: Path, *, progress: bool = True) -> Converted:
    """Read and check a GGUF file, keep its quantized blocks as they are and float tensors as float32; refuses
    before reading weights if a kind is unsupported or names or shapes differ."""
    import gguf

    reader = read_gguf(path)  # metadata and tensor index only (fast); no tensor byte is read before the checks
    try:  # a kind outside the table refuses the file
        check_supported((t.name, int(t.tensor_type)) for t in reader.tensors)
    except QuantError as e:
        raise CheckpointError(f"GGUF file {path}: {e}") from e
    meta = reader.fields
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    check_tokenizer(meta)  # refuse before the slow parts
    tokenizer_json, tok_info = build_tokenizer(meta)
    by_name = {t.name: t for t in reader.tensors}
    cfg = config_from_metadata(meta, set(by_name), tok_info)
    names = {gname: hf_name(gname) for gname in by_name}
    # GGUF lists dims fastest-first: reversed, they are the PyTorch shape
    check_shapes(cfg, {names[g]: tuple(int(d) for d in reversed(t.shape)) for g, t in by_name.items()})

    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, BlockTensor] = {}
    for gname, t in tqdm(by_name.items(), desc="tensors", unit="t", disable=not progress, leave=False):
        shape = tuple(int(d) for d in reversed(t.shape))
        heads = None
        if gname.startswith("blk.") and ".attn_q." in gname:
            heads = cfg.num_attention_heads
        elif gname.startswith("blk.") and ".attn_k." in gname:
            heads = cfg.num_key_value_heads
        kind = by_ggml_type(t.tensor_type)
        if kind is not None and kind.quantized and len(shape) == 2:
            try:
                bt = BlockTensor.from_gguf(t.data, kind.name, shape)
            except QuantError as e:
                raise CheckpointError(f"GGUF tensor {gname}: {e}") from e
            if heads is not None:  # the permutation moves whole rows, blocks included
                bt = bt.permute_rows(unpermute(np.arange(shape[0]), heads))
            quantized[names[gname]] = bt
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if heads is not None:
            w = unpermute(w, heads)
        tensors[names[gname]] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # owned, writable
    return Converted(
        family=cfg.family,
        config=cfg,
        tensors=tensors,
        tokenizer_json=tokenizer_json,
        tokenizer=tok_info,
        source=str(path),
        quantized=quantized,
    )
