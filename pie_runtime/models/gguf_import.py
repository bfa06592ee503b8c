"""Convert a llama.cpp GGUF file (architectures ``llama``, ``qwen2``, ``qwen3``, ``gemma3``: gguf_arch.py) into
the store's layout: tensors under Hugging Face names, a ModelConfig from the GGUF metadata, and a tokenizer.json
rebuilt from the embedded vocabulary (:mod:`.gguf_tokenizer`). Quantized weights of every kind in
``quant_kinds.KINDS`` are kept as their GGUF bytes (``Converted.quantized``, a :class:`~.quant_kinds.BlockTensor`
each, never requantized); float tensors become float32; a file holding a kind outside the table is refused before
any tensor is read.

Two traps: GGUF stores dims reversed (the reader already hands back row-major arrays in Hugging Face
order), and llama.cpp's converter permuted the q and k rows of ``llama`` files for its rope layout, which
:func:`unpermute` undoes (without it the logits are wrong although every shape fits). Gemma 3's norm weights
hold 1 + w in the file; the store keeps Hugging Face's w.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .checkpoint import CheckpointError, Converted, check_shapes
from .gguf_arch import ARCHITECTURES, ROPE_FREQS, architecture, config_from_metadata
from .gguf_meta import read_gguf
from .gguf_tokenizer import build_tokenizer, check_tokenizer
from .quant import QuantError
from .quant_kinds import BlockTensor, by_ggml_type, check_supported

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """GGUF tensor name → Hugging Face parameter name (gguf_arch.py's tables)."""
    return ARCHITECTURES[arch].hf_name(gguf_name)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs → Hugging Face's rotate-half halves)."""
    rows = w.shape[0]
    tail = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *tail).swapaxes(1, 2).reshape(w.shape)


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
    spec = architecture(meta)  # refuses an unsupported architecture before anything else is read
    check_tokenizer(meta)  # refuse before the slow parts
    tokenizer_json, tok_info = build_tokenizer(meta)
    by_name = {t.name: t for t in reader.tensors}
    freqs = by_name.pop(ROPE_FREQS, None)
    rope_freqs = None if freqs is None else gguf.quants.dequantize(freqs.data, freqs.tensor_type).ravel().tolist()
    cfg = config_from_metadata(meta, set(by_name), tok_info, rope_freqs)
    names = {gname: spec.hf_name(gname) for gname in by_name}
    # GGUF lists dims fastest-first: reversed, they are the PyTorch shape
    check_shapes(cfg, {names[g]: tuple(int(d) for d in reversed(t.shape)) for g, t in by_name.items()})

    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, BlockTensor] = {}
    for gname, t in tqdm(by_name.items(), desc="tensors", unit="t", disable=not progress, leave=False):
        shape = tuple(int(d) for d in reversed(t.shape))
        heads = None
        if spec.permute_qk and gname.startswith("blk.") and ".attn_q." in gname:
            heads = cfg.num_attention_heads
        elif spec.permute_qk and gname.startswith("blk.") and ".attn_k." in gname:
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
