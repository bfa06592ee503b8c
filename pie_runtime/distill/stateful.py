"""The teacher pass of a model with recurrent state (Mamba, LFM2): its own forward (models/mamba.py,
models/lfm2.py) over B sequences of one length at once, each a segment with a state slot of a private state
pool and, for a hybrid's attention layers, its own pages of a private KV cache. No gradients: these targets
serve the teacher pass only (an MTP head trains on the hidden states it gives; models/mtp.py is stateless).

The dense path (``dense.py``) is the Llama family's; this one runs the serving model's ragged forward, whose
logits the parity tests hold equal to transformers'.
"""

from __future__ import annotations

import torch

from ..models.context import ForwardContext, Segment
from ..models.families import CausalLM, state_shapes
from ..models.kv_cache import KVCache
from ..models.state_cache import StateCache

PAGE = 16


class _Batch:
    """B sequences of up to ``rows`` rows: a page table each and a state slot each."""

    def __init__(self, model: CausalLM, b: int, rows: int):
        cfg = model.config
        self.model, self.b = model, b
        self.pages = (rows + PAGE - 1) // PAGE
        dtype = next(model.parameters()).dtype
        self.kv = KVCache(cfg, b * self.pages, PAGE, dtype)
        self.state = StateCache(state_shapes(cfg), b)
        self.done = 0  # rows each sequence ran

    @torch.inference_mode()
    def run(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) the next T tokens of each sequence → (B, T, H) final normed hidden states."""
        b, t = ids.shape
        segments = [Segment(list(range(i * self.pages, (i + 1) * self.pages)), self.done, t, state=i) for i in range(b)]
        ctx = ForwardContext.build(segments, PAGE, layout=self.kv.layout)
        hidden = self.model(self.model.embed(ids.reshape(-1)), ctx, self.kv, self.state)  # type: ignore[arg-type]
        self.done += t
        return hidden.view(b, t, -1)


def stateful_hidden(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """(B, T) token ids from position 0 → (B, T, H) final normed hidden states."""
    return _Batch(model, ids.shape[0], ids.shape[1]).run(ids)


@torch.inference_mode()
def stateful_generate(model: CausalLM, prompts: list[list[int]], n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched greedy continuation, one row of each sequence a step: (tokens (B, P+n_new), hidden
    (B, P+n_new, H)), as ``dense.greedy_generate``."""
    ids = torch.tensor(prompts, dtype=torch.int64)
    batch = _Batch(model, ids.shape[0], ids.shape[1] + n_new)
    hid, toks = [batch.run(ids)], [ids]
    for _ in range(n_new):
        nxt = model.logits(hid[-1][:, -1]).argmax(dim=-1)  # (B,)
        toks.append(nxt.unsqueeze(1))
        hid.append(batch.run(nxt.unsqueeze(1)))
    return torch.cat(toks, dim=1), torch.cat(hid, dim=1)
