"""Writes a random-weight Llama GGUF of a given shape with the default model's tokenizer (SmolLM2's vocabulary,
read from the packaged GGUF: nothing is downloaded), for measuring the memory-bound regime on a bigger shape.

    python examples/make_gguf.py /tmp/smol-1.7b.gguf                      # SmolLM2-1.7B's shape, Q8_0
    python examples/make_gguf.py /tmp/smol-1.7b.gguf --quantize Q4_K_M    # then llama.cpp's quantizer

The weights are written as Q8_0 (norms F32), tensor by tensor; ``--quantize`` then runs llama.cpp's own
quantizer (``llama_model_quantize``, the library `pie bench decode` builds for its llama.cpp peer, in that
environment's Python) with ``allow_requantize``, so the kinds mix as llama.cpp mixes them (Q4_K, Q6_K, Q5_0 ...).
Weights are Gaussian with std 0.02 (the norms 1): the model is noise, but every pass streams what a real one of
the shape streams.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

QUANTIZE = """
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.allow_requantize, p.nthread = int(sys.argv[3]), True, 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""
FTYPES = {"Q4_K_M": 15, "Q4_K_S": 14, "Q5_K_M": 17, "Q5_K_S": 16, "Q6_K": 18, "Q4_0": 2, "Q5_0": 8}
TOKENIZER_FIELDS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)


def copy_tokenizer(src: Path, writer: gguf.GGUFWriter) -> int:
    """The tokenizer fields of ``src`` into ``writer``; returns the vocabulary size."""
    reader = gguf.GGUFReader(str(src))
    vocab = 0
    for key in TOKENIZER_FIELDS:
        field = reader.fields.get(key)
        if field is None:
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            vocab = len(value)
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    return vocab


def write(path: Path, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, seed: int) -> None:
    from pie_runtime.store import DEFAULT_MODEL, packaged_path

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    vocab = copy_tokenizer(packaged_path(DEFAULT_MODEL), writer)
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(130000.0)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)

    def matrix(name: str, rows: int, cols: int) -> None:
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        writer.add_tensor(
            name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
        )

    head_dim = hidden // heads
    matrix("token_embd.weight", vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        matrix(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def quantize(src: Path, dst: Path, kind: str) -> None:
    """llama.cpp's quantizer in the llama-cpp-python environment `pie bench decode` builds (built if missing)."""
    from pie_runtime.bench.llama_cpp_env import ensure_llama_cpp

    python = ensure_llama_cpp()
    subprocess.run([str(python), "-c", QUANTIZE, str(src), str(dst), str(FTYPES[kind])], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantize", choices=sorted(FTYPES), help="then requantize with llama.cpp to this type")
    a = ap.parse_args(argv)
    base = a.out.with_suffix(".q8_0.gguf") if a.quantize else a.out
    write(base, a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, a.seed)
    if a.quantize:
        quantize(base, a.out, a.quantize)
        base.unlink()
    print(f"wrote {a.out} ({a.out.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
