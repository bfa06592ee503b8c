"""A drafter's reduced vocabulary (Li et al. 2025, "EAGLE-3", §3.3): a chained draft step reads only the rows
of the target's lm head for the N tokens the target most often predicts, instead of all V.

On the default model (V = 49,152, hidden 576) the lm head is most of a draft step on a CPU, and an 8,192-row
slice costs a fraction of it (docs/performance.md, "A draft step's lm head"). A target token outside the slice
can never be drafted, so acceptance loses what the slice
does not cover; ``pie drafter train --draft-vocab N`` picks the slice from the target's own greedy choices
over the training data and reports the coverage.

Exactness does not depend on the slice: greedy verification keeps only drafts equal to the target's choice,
and a sampled round's draft distribution q is the softmax over the slice with zeros elsewhere, which is the q
the drafts were drawn from, so speculative sampling still keeps the target's distribution.

The ids live in the head's own file (tensor ``draft_ids``, int64, sorted); the slice's weights are cut from
the served lm head when the head is bound to its target, so they follow the engine's weight format.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .native_linear import PackedLinear
from .quant import Int8Linear

# Above this vocabulary a whole-vocabulary head reads more of the lm head per draft step than the rest of the
# target's pass costs (Gemma 3's 262,144 rows are most of its 270M parameters), so training picks a slice
# unless told otherwise; AUTO_SLICE keeps what EAGLE-3 found enough for a 128k vocabulary.
AUTO_ABOVE = 65_536
AUTO_SLICE = 32_768


def default_size(vocab_size: int, asked: int | None) -> int:
    """The draft vocabulary a training run uses: ``asked`` when given (0: the whole vocabulary), else the whole
    vocabulary up to AUTO_ABOVE tokens and an AUTO_SLICE-token slice above it."""
    if asked is not None:
        return asked
    return AUTO_SLICE if vocab_size > AUTO_ABOVE else 0


def frequent_ids(
    greedy: torch.Tensor, vocab_size: int, n: int, always: list[int] | tuple[int, ...] = ()
) -> torch.Tensor:
    """(n,) sorted int64 ids: ``always`` (e.g. the end-of-sequence tokens), then the most frequent of the
    target's greedy tokens ``greedy`` (any shape), ties broken by the lower id; n is capped at ``vocab_size``."""
    n = min(n, vocab_size)
    counts = torch.bincount(greedy.reshape(-1).long(), minlength=vocab_size).double()
    keep = torch.tensor([i for i in always if 0 <= i < vocab_size], dtype=torch.int64)
    counts[keep] = float("inf")
    order = torch.argsort(-counts, stable=True)  # stable: equal counts keep id order
    return torch.sort(order[:n]).values


def coverage(ids: torch.Tensor, greedy: torch.Tensor) -> float:
    """Fraction of the target's greedy tokens ``greedy`` that the slice ``ids`` can draft."""
    inside = torch.isin(greedy.reshape(-1).long(), ids)
    return float(inside.float().mean()) if inside.numel() else 0.0


def served_head_weight(lm_head: nn.Module, hidden_size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(V, H) the weight the served lm head multiplies by, in ``dtype``, whatever layer serves it (float,
    int8 or int4): read back as the head's output for the identity (minus its output for zero, a bias)."""
    with torch.inference_mode():
        eye = torch.eye(hidden_size, dtype=dtype, device=device)
        zero = torch.zeros(1, hidden_size, dtype=dtype, device=device)
        w = lm_head(eye) - lm_head(zero)  # (H, V)
    return w.T.contiguous()


class DraftLogits:
    """A drafter's lm head: the target's own (``ids`` None), or the slice of it for ``ids``. A call always
    gives (..., V) float32 logits, -inf outside the slice, so argmax and the samplers need nothing else."""

    def __init__(self, target_logits, lm_head: nn.Module, ids: torch.Tensor | None, hidden_size: int, vocab_size: int):
        self.target_logits = target_logits
        self.vocab_size = vocab_size
        self.ids = ids
        self.weight: torch.Tensor | None = None  # the slice's rows, dense (a float or a non-CPU head)
        # or the served head's own rows (a CPU int8 head, a native one): the head's bits for those rows
        self.rows: Int8Linear | PackedLinear | None = None
        if ids is not None:
            p = next(iter(lm_head.buffers()), None)
            p = next(iter(lm_head.parameters()), p)
            device = p.device if p is not None else torch.device("cpu")
            self.ids = ids.to(device=device, dtype=torch.int64)
            if isinstance(lm_head, PackedLinear) or (isinstance(lm_head, Int8Linear) and lm_head.on_cpu):
                self.rows = lm_head.rows(self.ids)
            else:
                dtype = p.dtype if p is not None and p.is_floating_point() else torch.bfloat16
                full = served_head_weight(lm_head, hidden_size, dtype, device)
                self.weight = full.index_select(0, self.ids).contiguous()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) normed hidden states → (..., V) float32 logits."""
        if self.ids is None:
            return self.target_logits(hidden)
        sub = self.slice_logits(hidden).float()
        out = sub.new_full((*hidden.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.ids] = sub
        return out

    def slice_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) normed hidden states → (..., N) logits of the slice's tokens, in the head's own dtype."""
        if self.rows is not None:
            return self.rows(hidden.to(self.rows.input_dtype))
        assert self.weight is not None  # a slice without the head's own rows has dense ones
        return hidden.to(self.weight.dtype) @ self.weight.T

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) normed hidden states → (...,) int64 argmax of :meth:`__call__`'s logits, without building them:
        with a slice, the argmax over its N logits mapped to its ids. The ids are sorted, so a tie goes to the
        lower id either way. A greedy chain's draft step then skips a (V,)-wide fill, scatter and argmax, a
        measurable share of a small head's step (docs/performance.md, "A draft step's lm head")."""
        if self.ids is None:
            return self.target_logits(hidden).argmax(dim=-1)
        return self.ids[self.slice_logits(hidden).argmax(dim=-1)]

    def draft(self, hidden: torch.Tensor, with_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A chain step's greedy draft (...,) from ``hidden``, and the (..., V) logits it was taken from when
        ``with_logits`` (a sampled readout's probabilities need them; a greedy one only the token, the same)."""
        if not with_logits:
            return self.greedy(hidden), None
        logits = self(hidden)
        return logits.argmax(dim=-1), logits


def draft_logits(module: nn.Module, target) -> DraftLogits:
    """The lm head a drafter module (MTP or EAGLE) drafts through, bound to its served ``target``: the slice
    for the module's ``draft_ids`` buffer when it has one, else the target's own."""
    ids = getattr(module, "draft_ids", None)
    cfg = target.config
    return DraftLogits(target.logits, target.lm_head, ids, cfg.hidden_size, cfg.vocab_size)


def set_draft_vocab(module: Any, ids: torch.Tensor | None) -> None:
    """Gives a drafter module the slice ``ids`` (None: the whole vocabulary), in its config (``draft_vocab``)
    and its ``draft_ids`` buffer, so that save and load carry it."""
    cfg = module.config
    module.config = cfg.model_copy(update={"draft_vocab": 0 if ids is None else int(ids.numel())})
    if ids is None:
        module._buffers.pop("draft_ids", None)
    else:
        module.register_buffer("draft_ids", ids.to(torch.int64).clone())
