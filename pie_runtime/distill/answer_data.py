"""`pie drafter data`'s answers as teacher data: the engine's hidden states read back, the target's top-k ids
ranked from them with the float32 lm head, cut into equal windows that training and agreement read.

An MTP head drafts from one position's hidden state and the tokens after it, never from the context before, so
cutting an answer into windows loses no information: every window keeps the hidden states the engine computed
with the whole conversation before it. Windows overlap by the draft depth so every start position is kept.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from ..models.families import CausalLM
from .answer_shards import Answer
from .data import TeacherData
from .teacher import top_ids


def _windows(n: int, first: int, length: int, step: int) -> list[int]:
    """Start positions of ``length``-position windows over positions ``first``..n-1, ``step`` apart, the last
    one flush with the end; none when fewer than ``length`` positions."""
    if n - first < length:
        return []
    starts = list(range(first, n - length + 1, step))
    if starts[-1] != n - length:
        starts.append(n - length)
    return starts


def answers_to_teacher(
    answers: list[Answer],
    head: CausalLM,
    length: int,
    depth: int,
    answer_only: bool = False,
    fast: bool = False,
    progress: bool = False,
) -> TeacherData | None:
    """The answers' windows of ``length`` positions as teacher data (None when no answer fills one). A window's
    top-k comes from its hidden states through ``head`` (``fast``: :func:`~.teacher.top_ids`'s bf16 search).
    ``answer_only``: windows start at the prompt's last position (whose hidden state predicts the answer's first
    token), so agreement counts the answer alone. ``progress``: a bar over the positions ranked."""
    toks, hid = [], []
    step = max(1, length - depth - 1)
    for a in answers:
        n = len(a.tokens) - 1  # positions with a hidden state
        first = a.prompt_len - 1 if answer_only else 0
        for s in _windows(n, first, length, step):
            toks.append(torch.tensor(a.tokens[s : s + length], dtype=torch.int64))
            hid.append(torch.from_numpy(a.hidden[s : s + length]))
    if not toks:
        return None
    tokens, hidden = torch.stack(toks), torch.stack(hid).to(torch.bfloat16)
    flat = hidden.reshape(-1, hidden.shape[-1])
    with tqdm(total=len(flat), unit="pos", desc="target top-k", disable=not progress) as bar:
        top = top_ids(head, flat, fast=fast, bar=bar).view(*tokens.shape, -1)
    return TeacherData(tokens, hidden, top)


def split_answers(answers: list[Answer]) -> tuple[list[Answer], list[Answer]]:
    """(training answers, held-out answers): held-out prompts' ids start with ``h-`` (chat_prompts.py)."""
    return [a for a in answers if not a.prompt_id.startswith("h-")], [
        a for a in answers if a.prompt_id.startswith("h-")
    ]
