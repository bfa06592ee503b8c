"""Helpers for the model tests: tiny random Hugging Face checkpoints of each family, and a runner that feeds
prompts through the paged cache in chosen chunks."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pie_runtime.models.config import ModelConfig
from pie_runtime.models.context import ForwardContext, Segment
from pie_runtime.models.families import CausalLM, state_shapes
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.state_cache import StateCache

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
RECURRENT_FAMILIES = ("mamba", "lfm2")  # state-space / hybrid: a recurrent state beside (or instead of) KV pages
ALL_FAMILIES = FAMILIES + RECURRENT_FAMILIES
TINY_VOCAB = 300


def tiny_llama_config(max_positions: int = 256) -> ModelConfig:
    """The geometry of the tiny random Llama the engine and drafter unit tests build in-process."""
    return ModelConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
    )


def tiny_tokenizer_json() -> str:
    """A byte-level BPE without merges: 256 byte tokens and two special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    return tok.to_str()


def hf_config(family: str):
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=256,
        eos_token_id=257,
    )
    # transformers 5's configs take rope_theta through **kwargs, which their signatures do not show
    if family == "llama":
        return transformers.LlamaConfig(**common, rope_theta=5e5, tie_word_embeddings=False)  # pyright: ignore[reportCallIssue]
    if family == "mistral":
        return transformers.MistralConfig(**common, rope_theta=1e6, sliding_window=None, tie_word_embeddings=False)  # pyright: ignore[reportCallIssue]
    if family == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False)  # pyright: ignore[reportCallIssue]
    if family == "mamba":
        return transformers.MambaConfig(
            vocab_size=TINY_VOCAB,
            hidden_size=64,
            state_size=8,
            num_hidden_layers=3,
            conv_kernel=4,
            expand=2,
            layer_norm_epsilon=1e-5,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=0,
            tie_word_embeddings=True,
            use_associative_scan=False,
        )
    if family == "lfm2":
        return transformers.Lfm2Config(
            vocab_size=TINY_VOCAB,
            hidden_size=64,
            intermediate_size=96,
            block_multiple_of=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            conv_L_cache=3,
            max_position_embeddings=256,
            norm_eps=1e-5,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=0,
            tie_word_embeddings=True,
        )
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=24, rope_theta=1e6, tie_word_embeddings=True)  # pyright: ignore[reportCallIssue]
    raise ValueError(family)


def write_tiny_checkpoint(folder: Path, family: str, seed: int = 0) -> None:
    """Random weights large enough that a wrong layout shows in the logits."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))


def run_chunks(
    model: CausalLM,
    prompts: list[list[int]],
    chunks: list[list[int]],
    page_size: int,
    page_tables: list[list[int]],
) -> list[torch.Tensor]:
    """Feed each prompt through the paged cache in steps; step s feeds chunks[p][s] rows of prompt p (all
    prompts of a step in one forward). Returns each prompt's (T, V) logits, one row per token. A recurrent
    model's prompts advance state-pool entries (in reverse order, so that entry and batch order differ)."""
    num_pages = max(max(t) for t in page_tables) + 1
    kv = KVCache(model.config, num_pages, page_size, torch.float32)
    shapes = state_shapes(model.config)
    state = StateCache(shapes, len(prompts)) if shapes else None
    done = [0] * len(prompts)
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(max(len(c) for c in chunks)):
        segments, ids, owners = [], [], []
        for p, prompt in enumerate(prompts):
            if step >= len(chunks[p]):
                continue
            n = chunks[p][step]
            entry = len(prompts) - 1 - p if state is not None else None
            segments.append(Segment(page_tables[p], done[p], n, state=entry))
            ids += prompt[done[p] : done[p] + n]
            owners.append((p, n))
            done[p] += n
        ctx = ForwardContext.build(segments, page_size, layout=kv.layout)
        hidden = model.forward(model.embed(torch.tensor(ids)), ctx, kv, state)  # type: ignore[arg-type]
        logits = model.logits(hidden)
        row = 0
        for p, n in owners:
            out[p].append(logits[row : row + n])
            row += n
    assert done == [len(p) for p in prompts]
    return [torch.cat(o) for o in out]
