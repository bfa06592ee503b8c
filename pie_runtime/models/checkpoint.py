"""What an importer hands to the store: a converted checkpoint (config, Hugging Face-named tensors, float or
kept quantized as the source's blocks, tokenizer.json text, tokenizer facts), and the shape check every
importer runs before reading weights.

Importers raise :class:`CheckpointError` (or the config's ``UnsupportedModelError``); the store turns
both into its own ``ImportRefused`` so that callers see one error family.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict

from .config import AnyConfig
from .families import build_causal_lm
from .quant_kinds import BlockTensor

# Tensors some checkpoints carry that the model recomputes or does not need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The checkpoint cannot be converted: a missing or misshapen tensor, an unreadable file, ..."""


class TokenizerInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    bos_token_id: int | None = None
    eos_token_ids: list[int] = []
    chat_template: str | None = None
    special_tokens: list[str] = []
    # whether a plain prompt starts with BOS / ends with EOS (GGUF ``tokenizer.ggml.add_bos_token``, Hugging Face
    # tokenizer.json's post-processor); the SDK adds them once (``inferlet.Tokenizer.encode_prompt``)
    add_bos_token: bool = False
    add_eos_token: bool = False


@dataclass
class Converted:
    """A checkpoint in the store's layout, still in memory."""

    family: str
    config: AnyConfig
    tensors: dict[str, torch.Tensor]  # Hugging Face names, float32, no lm_head when embeddings are tied
    tokenizer_json: str
    tokenizer: TokenizerInfo
    source: str
    # weights kept as the source's quantized blocks (any quantized kind of quant_kinds.KINDS), by Hugging Face
    # name; a name is either here or in ``tensors``, never both
    quantized: dict[str, BlockTensor] = field(default_factory=dict)


def expected_shapes(cfg: AnyConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor a checkpoint for ``cfg`` must hold (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = build_causal_lm(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def check_shapes(cfg: AnyConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse a checkpoint whose tensor names or shapes differ from what ``cfg`` builds."""
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(shapes))
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]}{more}")
    unexpected = sorted(set(shapes) - set(want))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]}")
    for name, shape in shapes.items():
        if tuple(shape) != want[name]:
            raise CheckpointError(f"tensor {name} has shape {tuple(shape)}, the config needs {want[name]}")


def drop_ignored(names: list[str], cfg: AnyConfig) -> list[str]:
    """Names minus recomputed buffers and, for tied embeddings, the duplicate lm_head."""
    out = [n for n in names if not n.endswith(IGNORED_SUFFIXES)]
    if cfg.tie_word_embeddings:
        out = [n for n in out if n != "lm_head.weight"]
    return out


def count_parameters(tensors: dict[str, torch.Tensor], quantized: dict[str, BlockTensor] | None = None) -> int:
    return sum(t.numel() for t in tensors.values()) + sum(b.n * b.k for b in (quantized or {}).values())
