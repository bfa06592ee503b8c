"""The KV pool's memory: a pool sized for many sequences is resident only where it was written."""

from __future__ import annotations

import torch

from pie_runtime.bench.rss import rss_mib
from pie_runtime.models.config import ModelConfig
from pie_runtime.models.kv_cache import KVCache


def test_a_large_pool_costs_memory_only_where_tokens_were_written():
    """The default model's shape (30 layers, 3 key heads, head-major), a 1 GiB bfloat16 pool: one sequence's
    first 128 tokens in every layer and head make ~3 MiB resident, not 2 MiB per layer and head (a huge page
    behind each write, as numpy's allocator asked for)."""
    cfg = ModelConfig(
        vocab_size=100,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
    )
    pages = (1 << 30) // KVCache.bytes_per_page(cfg, 16, torch.bfloat16)
    before = rss_mib()
    kv = KVCache(cfg, pages, 16, torch.bfloat16)
    kv.k[:, :, :128] = 1.0
    kv.v[:, :, :128] = 1.0
    grown = (rss_mib() or 0.0) - (before or 0.0)
    assert kv.nbytes > 0.99 * (1 << 30) and float(kv.k[29, 2, 127, 63]) == 1.0 and float(kv.k[0, 0, 128, 0]) == 0.0
    assert grown < 64, f"{grown:.0f} MiB resident after writing 128 tokens"
