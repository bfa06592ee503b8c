"""What bounds batch-1 decode on a CPU: the machine's read bandwidth (a streaming read of a buffer larger than the
last-level cache, timed in the bench's own run) and the bytes of weights each runner streams a token, so that
`pie bench decode` can say what share of the bandwidth each runner reaches (decode tok/s x bytes / bandwidth).

Bytes a token streams count every weight a decode pass reads once: the projections and the lm head in the form
the runner holds them (the native step's records, torch's packed int4/int8, a GGUF's own blocks for llama.cpp),
not the embedding table (a token reads one row of it) unless it is also the tied head; the KV cache and the
activations are left out (a few percent at these prompt lengths).
"""

from __future__ import annotations

import time
from pathlib import Path

# bytes per weight of each form a runner holds weights in (the native step's x8 records: values + scales per
# 32 weights of 8 outputs; qmatmul.h)
NATIVE_BYTES = {"q4": 160 / 256, "q8": 272 / 256}
# WX records by GGUF kind (a float part is Q8_0): 8 outputs x 32 weights a record, the K kinds with a 32-byte
# header per 8 records; Q6_K's values in 4 + 2-bit planes
WX_BYTES = {
    "q4_0": 144 / 256,
    "q4_1": 160 / 256,
    "q5_0": 176 / 256,
    "q5_1": 192 / 256,
    "q8_0": 272 / 256,
    "q4_k": (144 + 4) / 256,
    "q5_k": (176 + 4) / 256,
    "q6_k": (208 + 4) / 256,
}
TORCH_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 32}
_FLOOR = 512 << 20  # the smallest buffer streamed, whatever the cache


def last_level_cache_bytes() -> int:
    """The largest CPU cache /sys reports (0 when it says nothing)."""
    best = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """GB/s of a streaming read (``torch.sum`` over float32) of max(512 MiB, 8x the last-level cache) with
    ``threads`` threads: the best of ``repeats`` reads, after one that faults the pages in."""
    import torch

    size = max(_FLOOR, 8 * last_level_cache_bytes())
    buf = torch.ones(size // 4, dtype=torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = float("inf")
        for _ in range(repeats + 1):
            t = time.perf_counter()
            torch.sum(buf)
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return size / best / 1e9


def native_bytes(parts: list[tuple[str, int]], fmt: str) -> float:
    """Bytes of one weight fused of ``parts`` (stored kind, "" for float; weights) on the native step in ``fmt``:
    each part's own records where they run as WX (a float part as Q8_0), else the fused weight's kernel."""
    from ..native_load import plan

    how = plan([k for k, _ in parts], fmt)
    if how == "wx":
        return sum(weights * WX_BYTES[k or "q8_0"] for k, weights in parts)
    return sum(weights for _, weights in parts) * NATIVE_BYTES["q4" if how.startswith("q4") else "q8"]


def pie_token_bytes(manifest, fmt: str, native: bool) -> int | None:
    """Bytes of weights a pie decode token streams in ``fmt`` (None: not a Llama-family model)."""
    from ..models.config import ModelConfig

    cfg = manifest.config
    if not isinstance(cfg, ModelConfig):
        return None
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {
        "self_attn.q_proj": cfg.num_attention_heads * d * hidden,
        "self_attn.k_proj": cfg.num_key_value_heads * d * hidden,
        "self_attn.v_proj": cfg.num_key_value_heads * d * hidden,
        "self_attn.o_proj": hidden * cfg.num_attention_heads * d,
        "mlp.gate_proj": inter * hidden,
        "mlp.up_proj": inter * hidden,
        "mlp.down_proj": hidden * inter,
    }
    groups = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",))
    groups += (("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head_weights = cfg.vocab_size * hidden
    if not native or fmt not in ("gguf", "int4", "int8"):
        per = TORCH_BYTES["int4" if fmt == "gguf" else fmt]
        head_per = TORCH_BYTES["int8"] if fmt in ("int4", "int8", "gguf") else per
        return int(cfg.num_hidden_layers * sum(shapes.values()) * per + head_weights * head_per)
    q = manifest.quantized
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        for parts in groups:
            total += native_bytes([(q.get(f"model.layers.{i}.{p}.weight", ""), shapes[p]) for p in parts], fmt)
    total += native_bytes([(q.get(head, ""), head_weights)], "gguf" if fmt == "gguf" else "int8")
    return int(total)


def gguf_token_bytes(path: Path) -> int:
    """Bytes of a GGUF's tensors a llama.cpp decode token streams: all but the embedding table, which counts only
    where it is also the head (no output.weight)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    return sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight" or tied)
