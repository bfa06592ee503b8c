"""The distillation loss: the student is trained to reproduce the target's distribution
``softmax(lm_head(h_t))`` at every position. The loss at a position is

    KL(p_target || p_student) over a candidate set C  +  alpha * |h_student - h_target|^2 / |h_target|^2

where C is the union of the batch's target top-k tokens and some random ones (the full 49K-way softmax
costs far more on a CPU and adds little: the mass outside the target's top-k is small), and the
hidden-state term pulls the student's final hidden state towards the target's, which matches the whole
distribution at once since the head is shared.
"""

from __future__ import annotations

import torch


def candidates(top: torch.Tensor, vocab: int, n_random: int, gen: torch.Generator) -> torch.Tensor:
    """Union of the rows' target top-k ids and ``n_random`` random ids: the vocabulary the loss sees."""
    rand = torch.randint(0, vocab, (n_random,), generator=gen)
    return torch.unique(torch.cat([top.reshape(-1).long(), rand]))


def distill_loss(
    student_h: torch.Tensor, teacher_h: torch.Tensor, head_w: torch.Tensor, cand: torch.Tensor, alpha: float
) -> torch.Tensor:
    """student_h, teacher_h: (N, H) final normed hidden; head_w: (V, H) the shared lm head."""
    w = head_w[cand]  # (C, H)
    s = student_h.float() @ w.T
    with torch.no_grad():
        p = torch.softmax(teacher_h.float() @ w.T, dim=-1)
    kl = (p * (torch.log(p.clamp_min(1e-12)) - torch.log_softmax(s, dim=-1))).sum(-1).mean()
    th = teacher_h.float()
    mse = ((student_h.float() - th) ** 2).sum(-1).mean() / (th**2).sum(-1).mean()
    return kl + alpha * mse
