"""Convert a llama.cpp GGUF file (architectures ``llama``, ``qwen2``, ``qwen3``, ``gemma3``: gguf_arch.py) into
the store's layout: tensors under Hugging Face names, a ModelConfig from the GGUF metadata, and a tokenizer.json
rebuilt from the embedded GPT-2 byte-level BPE vocabulary. Q4_0, Q4_1 and Q8_0 weights are kept as their
blocks (``Converted.quantized``, a :class:`~.quant.GroupQuant` each, never requantized); every other type is
dequantized to float32.

Two traps: GGUF stores dims reversed (the reader already hands back row-major arrays in Hugging Face
order), and llama.cpp's converter permuted the q and k rows of ``llama`` files for its rope layout, which
:func:`unpermute` undoes (without it the logits are wrong although every shape fits). Gemma 3's norm weights
hold 1 + w in the file; the store keeps Hugging Face's w.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .checkpoint import CheckpointError, Converted, TokenizerInfo, check_shapes
from .config import UnsupportedModelError
from .gguf_arch import ARCHITECTURES, ROPE_FREQS, architecture, config_from_metadata
from .quant import GroupQuant, QuantError, from_gguf, ggml_kind

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: special tokens such as <|im_start|>


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """GGUF tensor name → Hugging Face parameter name (gguf_arch.py's tables)."""
    return ARCHITECTURES[arch].hf_name(gguf_name)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs → Hugging Face's rotate-half halves)."""
    rows = w.shape[0]
    tail = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *tail).swapaxes(1, 2).reshape(w.shape)


def _fields(reader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def build_tokenizer(meta: dict[str, Any]) -> tuple[str, TokenizerInfo]:
    """tokenizer.json text and tokenizer facts from the GGUF's ``tokenizer.ggml.*`` fields."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2 (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default"):
        pre_tokenizer = byte_level
    else:
        raise UnsupportedModelError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: smollm, gpt2, default")

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        bos_tok = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_tok} $A", pair=f"{bos_tok} $A {bos_tok} $B", special_tokens=[(bos_tok, bos)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    eos_ids = [int(eos)] if eos is not None else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    info = TokenizerInfo(
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens=special,
    )
    return tok.to_str(), info


def convert_gguf(path: Path, *, progress: bool = True) -> Converted:
    """Read and check a GGUF file, keep its Q4_0/Q4_1/Q8_0 blocks and dequantize the rest; refuses before
    reading weights if names or shapes differ."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read GGUF file {path}: {e}") from e
    meta = _fields(reader)
    spec = architecture(meta)  # refuses an unsupported architecture before anything else is read
    tokenizer_json, tok_info = build_tokenizer(meta)
    by_name = {t.name: t for t in reader.tensors}
    freqs = by_name.pop(ROPE_FREQS, None)
    rope_freqs = None if freqs is None else gguf.quants.dequantize(freqs.data, freqs.tensor_type).ravel().tolist()
    cfg = config_from_metadata(meta, set(by_name), tok_info, rope_freqs)
    names = {gname: spec.hf_name(gname) for gname in by_name}
    # GGUF lists dims fastest-first: reversed, they are the PyTorch shape
    check_shapes(cfg, {names[g]: tuple(int(d) for d in reversed(t.shape)) for g, t in by_name.items()})

    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, GroupQuant] = {}
    for gname, t in tqdm(by_name.items(), desc="tensors", unit="t", disable=not progress, leave=False):
        shape = tuple(int(d) for d in reversed(t.shape))
        heads = None
        if spec.permute_qk and gname.startswith("blk.") and ".attn_q." in gname:
            heads = cfg.num_attention_heads
        elif spec.permute_qk and gname.startswith("blk.") and ".attn_k." in gname:
            heads = cfg.num_key_value_heads
        if ggml_kind(t.tensor_type) is not None and len(shape) == 2:
            try:
                gq = from_gguf(t.data, t.tensor_type, shape)
            except QuantError as e:
                raise CheckpointError(f"GGUF tensor {gname}: {e}") from e
            if heads is not None:  # the permutation moves whole rows, blocks included
                gq = gq.permute_rows(unpermute(np.arange(shape[0]), heads))
            quantized[names[gname]] = gq
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if heads is not None:
            w = unpermute(w, heads)
        if spec.norm_shift and spec.is_norm(gname):
            w = w - np.float32(spec.norm_shift)
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
