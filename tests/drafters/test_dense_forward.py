"""Drafter training's dense forward (``pie_runtime.distill.dense``: plain causal attention over (B, T)) agrees
with the engine's paged forward (``pie_runtime.models.llama`` over a ``KVCache`` and a ``ForwardContext``) on
the same weights: the final hidden states and logits of every position, in float32, for small random models
with each attention switch; and ``greedy_generate``'s dense-cache decode picks the tokens and hidden states
that paged decode does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pie_runtime.distill import dense_hidden, greedy_generate
from pie_runtime.models.config import ModelConfig
from pie_runtime.models.context import ForwardContext, Segment
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.llama import LlamaForCausalLM
from pie_runtime.store import build_model

VOCAB = 300
ATOL, RTOL = 2e-5, 1e-5  # float32; the two paths sum attention in different orders
PAGE = 4


def config(**switches: Any) -> ModelConfig:
    """A 3-layer model of width 64 with the given attention switches."""
    return ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        **switches,
    )


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CONFIGS = {
    "llama-gqa": config(num_key_value_heads=2, head_dim=16, rope_theta=5e5),
    "qwen2-bias-tied": config(
        family="qwen2", num_key_value_heads=2, head_dim=16, attention_bias=True, tie_word_embeddings=True
    ),
    "qwen3-qknorm": config(family="qwen3", num_key_value_heads=1, head_dim=24, qk_norm=True),
    "llama3-mha-obias": config(
        num_key_value_heads=4, head_dim=16, attention_bias=True, o_proj_bias=True, rope_scaling=LLAMA3_ROPE
    ),
    "mistral-window": config(family="mistral", num_key_value_heads=2, head_dim=16, sliding_window=6),
    "gemma3-recipe": config(
        family="gemma3",
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        sliding_window=6,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        hidden_activation="gelu_pytorch_tanh",
        norm_weight_offset=1.0,
        sandwich_norms=True,
        scale_embeddings=True,
        qk_norm=True,
        query_pre_attn_scalar=24,
    ),
}


def random_model(cfg: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    """Random weights large enough that a wrong attention (mask, rotary, norm, grouping) shows in the outputs."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, s in shapes.items():
        noise = torch.randn(s, generator=g)
        state[k] = 1 + 0.1 * noise if k.endswith("norm.weight") else 0.15 * noise
    model = build_model(cfg, state, torch.float32, "cpu")
    assert isinstance(model, LlamaForCausalLM)
    return model


def paged_hidden(model: LlamaForCausalLM, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """(B, T) ids → (B, T, H) final hidden states through the paged cache: step s feeds every sequence's next
    ``chunks[s]`` tokens in one forward; the sequences' pages are interleaved in the pool."""
    b, t = ids.shape
    assert sum(chunks) == t
    per = -(-t // PAGE)
    kv = KVCache(model.config, b * per, PAGE, torch.float32)
    tables = [list(range(i, b * per, b)) for i in range(b)]
    out, start = [], 0
    for n in chunks:
        ctx = ForwardContext.build([Segment(tables[i], start, n) for i in range(b)], PAGE, layout=kv.layout)
        out.append(model(model.embed(ids[:, start : start + n].reshape(-1)), ctx, kv).view(b, n, -1))
        start += n
    return torch.cat(out, dim=1)


def paged_greedy(model: LlamaForCausalLM, prompts: torch.Tensor, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decode through the paged cache, one row per sequence a step: (tokens, hidden) as
    ``greedy_generate`` returns them."""
    b, p = prompts.shape
    per = -(-(p + n_new) // PAGE)
    kv = KVCache(model.config, b * per, PAGE, torch.float32)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
    ctx = ForwardContext.build([Segment(tables[i], 0, p) for i in range(b)], PAGE, layout=kv.layout)
    hid = [model(model.embed(prompts.reshape(-1)), ctx, kv).view(b, p, -1)]
    toks = [prompts]
    for step in range(n_new):
        nxt = model.logits(hid[-1][:, -1]).argmax(dim=-1)
        toks.append(nxt.unsqueeze(1))
        ctx = ForwardContext.build([Segment(tables[i], p + step, 1) for i in range(b)], PAGE, layout=kv.layout)
        hid.append(model(model.embed(nxt), ctx, kv).view(b, 1, -1))
    return torch.cat(toks, dim=1), torch.cat(hid, dim=1)


@pytest.mark.parametrize("name", CONFIGS)
def test_dense_forward_matches_paged(name):
    model = random_model(CONFIGS[name])
    ids = torch.randint(0, VOCAB, (3, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # as the teacher pass runs it; training runs the same code with gradients
        dense = dense_hidden(model, ids)
    # a prefill chunk of its own, a padded short chunk, single decode rows, then the rest
    paged = paged_hidden(model, ids, [9, 5, 1, 1, 7])
    assert dense.shape == paged.shape == (3, 23, 64)
    assert dense.abs().mean() > 0.1  # a real signal, not a degenerate model
    torch.testing.assert_close(dense, paged, atol=ATOL, rtol=RTOL)
    h = dense.shape[-1]
    logits, want = model.logits(dense.reshape(-1, h)), model.logits(paged.reshape(-1, h))
    torch.testing.assert_close(logits, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-qknorm", "gemma3-recipe"])
def test_greedy_generate_matches_paged_decode(name):
    model = random_model(CONFIGS[name], seed=2)
    prompts = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(3))
    tokens, hidden = greedy_generate(model, prompts.tolist(), 10)
    want_tokens, want_hidden = paged_greedy(model, prompts, 10)
    assert tokens.shape == (4, 16) and hidden.shape == (4, 16, 64)
    assert torch.equal(tokens, want_tokens)
    assert len(set(tokens[:, 6:].reshape(-1).tolist())) > 4  # the decode really varies
    torch.testing.assert_close(hidden, want_hidden, atol=ATOL, rtol=RTOL)
