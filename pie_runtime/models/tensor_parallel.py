"""Tensor parallelism (Megatron-LM's split, Shoeybi et al. 2019) of the Llama family over torch.distributed:
each of T ranks holds a shard of every projection and runs the same forward on its shard.

- **Attention**: the key/value heads are split between the ranks (as evenly as they go), each rank taking the
  query heads that read its key heads; q, k and v are *column-parallel* (each rank computes its heads), the
  output projection *row-parallel* (each rank multiplies its heads' columns, then an all-reduce sums).
- **MLP**: gate and up column-parallel, down row-parallel (one all-reduce).
- **lm head**: *vocab-parallel*: each rank scores its slice of the vocabulary, an all-gather joins them.
- The embedding, the norms and the rotary tables are replicated; after each all-reduce every rank holds the
  same hidden states, so the ranks' KV caches hold their own heads only.

``shard`` rewrites a loaded float32 model in place; the group (who announces what, see ``engine/tp_worker.py``)
is the engine's. Biases of row-parallel layers are added once, after the sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .llama import DecoderLayer, LlamaForCausalLM


def split(n: int, world: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank's share of ``n`` items, the first ranks one larger when it does not divide."""
    base, extra = divmod(n, world)
    out, start = [], 0
    for r in range(world):
        stop = start + base + (r < extra)
        out.append((start, stop))
        start = stop
    return out


class ColumnParallelLinear(nn.Module):
    """Output features ``[start, stop)`` of a linear layer: (N, in) → (N, stop - start), no communication."""

    def __init__(self, full: nn.Linear, start: int, stop: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[start:stop].clone(), requires_grad=False)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[start:stop].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features ``[start, stop)`` of a linear layer: (N, stop - start) → (N, out), summed over ranks."""

    def __init__(self, full: nn.Linear, start: int, stop: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[:, start:stop].clone(), requires_grad=False)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelHead(nn.Module):
    """Rank ``r`` scores vocabulary rows ``ranges[r]``; an all-gather returns every rank the full (N, V). Rank 0
    calls it through ``engine/tp_worker.AnnouncedHead``, which first tells the other ranks to join."""

    def __init__(self, full: nn.Linear, ranges: list[tuple[int, int]], rank: int) -> None:
        super().__init__()
        start, stop = ranges[rank]
        self.weight = nn.Parameter(full.weight.detach()[start:stop].clone(), requires_grad=False)
        self.sizes = [b - a for a, b in ranges]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)  # (N, V_r)
        width = max(self.sizes)
        if local.shape[1] < width:  # all_gather needs equal shapes
            local = F.pad(local, (0, width - local.shape[1]))
        parts = [torch.empty_like(local) for _ in self.sizes]
        dist.all_gather(parts, local.contiguous())
        return torch.cat([p[:, :n] for p, n in zip(parts, self.sizes)], dim=1)


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Raises ValueError when the model cannot be split ``world`` ways."""
    if world < 1:
        raise ValueError("--tensor-parallel must be at least 1")
    if cfg.num_key_value_heads < world:
        raise ValueError(
            f"--tensor-parallel {world}: the model has {cfg.num_key_value_heads} key/value heads, fewer than ranks"
        )


def local_config(cfg: ModelConfig, rank: int, world: int) -> ModelConfig:
    """The config of rank ``rank``'s shard (its heads): what its KV cache is sized by."""
    a, b = split(cfg.num_key_value_heads, world)[rank]
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    return cfg.model_copy(update={"num_key_value_heads": b - a, "num_attention_heads": (b - a) * group})


def shard(model: LlamaForCausalLM, rank: int, world: int) -> None:
    """Replaces ``model``'s projections and lm head by rank ``rank``'s shards (float32 weights as loaded)."""
    cfg = model.config
    check_shardable(cfg, world)
    d = cfg.head_dim
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    a, b = split(cfg.num_key_value_heads, world)[rank]
    m0, m1 = split(cfg.intermediate_size, world)[rank]
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is not None or mlp.gate_up_proj is not None:
            raise ValueError("tensor parallelism shards the float32 model as loaded, not fused projections")
        _swap(attn, "q_proj", lambda w: ColumnParallelLinear(w, a * group * d, b * group * d))
        _swap(attn, "k_proj", lambda w: ColumnParallelLinear(w, a * d, b * d))
        _swap(attn, "v_proj", lambda w: ColumnParallelLinear(w, a * d, b * d))
        _swap(attn, "o_proj", lambda w: RowParallelLinear(w, a * group * d, b * group * d))
        attn.heads, attn.kv_heads = (b - a) * group, b - a
        _swap(mlp, "gate_proj", lambda w: ColumnParallelLinear(w, m0, m1))
        _swap(mlp, "up_proj", lambda w: ColumnParallelLinear(w, m0, m1))
        _swap(mlp, "down_proj", lambda w: RowParallelLinear(w, m0, m1))
    _swap(model, "lm_head", lambda w: VocabParallelHead(w, split(cfg.vocab_size, world), rank))


def _swap(owner: nn.Module, name: str, make: Callable[[nn.Linear], nn.Module]) -> None:
    """Replaces the linear layer ``owner.name`` by ``make(it)`` (the full weight is dropped with it)."""
    full = getattr(owner, name)
    assert isinstance(full, nn.Linear)
    setattr(owner, name, make(full))
