"""How often a drafter's drafts equal the target's greedy tokens on teacher data: per draft position, the
acceptance rate a speculative round would see (the training progress bar, ``pie drafter train``'s report
and ``examples/drafters/eval_drafters.py``)."""

from __future__ import annotations

import torch

from ..models.llama import LlamaForCausalLM
from ..models.mtp import MTPHead
from .data import TeacherData
from .dense import dense_hidden


@torch.no_grad()
def follows_greedy(data: TeacherData) -> torch.Tensor:
    """(S, T-1) bool: token t+1 of the data is the target's greedy choice after position t (always true
    on the target's own greedy continuations; on corpus text only where the text agrees with it)."""
    return data.tokens[:, 1:] == data.top[:, :-1, 0].long()


@torch.no_grad()
def mtp_agreement(
    head: MTPHead, data: TeacherData, depth: int, conditional: bool = False, start: int = 0
) -> list[float]:
    """Per draft position j = 1..depth, how often the chained MTP draft equals the target's greedy token.

    At position t the chain starts from h_t and token t+1 (the readout's column 0 when the data follows
    the target's greedy choice) and feeds each draft to the next step, as served. Draft j is compared with
    the target's greedy choice after position t+j, counted only where tokens t+1..t+j are the target's
    greedy path (so the comparison is what a speculative round would see). ``conditional``: only count
    rows whose drafts 1..j-1 agreed too (the acceptance rate at position j). Positions before ``start``
    are context only."""
    if start:
        data = data.from_position(start)
    s, t = data.tokens.shape
    n = t - depth - 1
    if n <= 0:
        return [0.0] * depth
    h = data.hidden[:, :n].reshape(-1, data.hidden.shape[-1]).float()
    first = data.tokens[:, 1 : n + 1].reshape(-1)
    chunks = [
        head.draft(h[i : i + 2048], first[i : i + 2048], depth, with_logits=False)[0] for i in range(0, len(h), 2048)
    ]
    drafts = torch.cat(chunks)  # (S*n, depth)
    follows = follows_greedy(data)
    valid = torch.ones_like(first, dtype=torch.bool)
    out = []
    for j in range(1, depth + 1):
        valid &= follows[:, j - 1 : j - 1 + n].reshape(-1)
        ok = drafts[:, j - 1] == data.top[:, j : j + n, 0].reshape(-1).long()
        out.append(float(ok[valid].float().mean()) if valid.any() else 0.0)
        if conditional:
            valid &= ok
    return out


@torch.no_grad()
def draft_agreement(
    draft: LlamaForCausalLM, data: TeacherData, depth: int = 1, batch: int = 4, start: int = 0
) -> list[float]:
    """Per draft position j = 1..depth, the acceptance rate of the draft model's greedy drafts: draft j
    agrees with the target's greedy token given that drafts 1..j-1 did. With 1..j-1 accepted the draft
    model has read exactly the target's greedy tokens, so draft j is its teacher-forced argmax at t+j-1,
    compared with the target's greedy token there; rows count only where the data's tokens t+1..t+j-1
    are that greedy path (all rows on the target's own greedy continuations)."""
    oks = []
    for i in range(0, len(data.tokens), batch):
        ids = data.tokens[i : i + batch]
        h = dense_hidden(draft, ids)
        pred = draft.logits(h.reshape(-1, h.shape[-1])).argmax(-1).view(ids.shape)
        oks.append(pred == data.top[i : i + batch, :, 0].long())
    ok = torch.cat(oks)[:, start:]  # (S, T): draft's argmax at t equals the target's
    follows = follows_greedy(data)[:, start:]
    s, t = ok.shape
    n = t - depth
    out = []
    valid = torch.ones(s, n, dtype=torch.bool)
    for j in range(depth):
        if j:
            valid &= follows[:, j - 1 : j - 1 + n]
        hit = ok[:, j : j + n]
        out.append(float(hit[valid].float().mean()) if valid.any() else 0.0)
        valid &= hit
    return out
