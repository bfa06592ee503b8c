"""The teacher pass: the frozen target's view of the training data, computed once and cached.

Labels are the target's own predictions, never the corpus's next words: for every training position the
target's final hidden state ``h_t`` is kept (bfloat16) with its top-k token ids, over corpus windows
(teacher-forced) and over the target's own greedy continuations of corpus prompts.

Precision (``--precision``, default bf16 on CPUs with bf16 units): the teacher pass runs a bfloat16 copy of
the target, its top-k re-ranked with the float32 head (what it gains and costs: docs/performance.md, "Drafter
training").
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..models.families import CausalLM
from ..models.llama import LlamaForCausalLM
from .data import CHAT_PROMPT_LEN, GEN_ROUND_TOKENS, TOP_K, DataPlan, TeacherData
from .dense import dense_hidden, greedy_generate
from .stateful import stateful_generate, stateful_hidden

if TYPE_CHECKING:
    from tqdm import tqdm


def teacher_model(model: CausalLM, dtype: torch.dtype) -> CausalLM:
    """The target for the teacher pass: itself, or a copy with its weights in ``dtype`` (bfloat16: faster on CPUs
    with bf16 units, and nearly all its greedy labels equal the float32 target's).
    A target with recurrent state is always itself (its state pool is float32)."""
    if dtype == next(model.parameters()).dtype or not isinstance(model, LlamaForCausalLM):
        return model
    return copy.deepcopy(model).to(dtype)


@torch.inference_mode()
def top_ids(
    model: CausalLM,
    hidden: torch.Tensor,
    k: int = TOP_K,
    chunk: int = 1024,
    fast: bool = False,
    bar: tqdm | None = None,
) -> torch.Tensor:
    """(N, H) → (N, k) int32 ids of the target's k most likely tokens, best first. ``fast``: a bfloat16
    product finds 4k candidates, re-ranked with the float32 head (cheaper on CPUs with bf16 units; the same
    ids unless a true top-k token falls outside the bf16 top-4k). ``bar`` advances by the rows done."""
    out = []
    w = model.lm_head.weight
    w16 = w.to(torch.bfloat16) if fast else w  # read only when fast
    for i in range(0, len(hidden), chunk):
        h = hidden[i : i + chunk].float()
        if not fast:
            out.append(model.logits(h).topk(k, dim=-1).indices)
        else:
            cand = (h.to(torch.bfloat16) @ w16.T).topk(4 * k, dim=-1).indices  # (n, 4k)
            exact = torch.einsum("nh,nch->nc", h, w.float()[cand])
            out.append(cand.gather(1, exact.topk(k, dim=-1).indices))
        if bar is not None:
            bar.update(len(h))
    return torch.cat(out).to(torch.int32)


def teacher_windows(
    model: CausalLM,
    windows: list[list[int]],
    batch: int = 4,
    bar: tqdm | None = None,
    head: CausalLM | None = None,
) -> TeacherData:
    """``model`` runs the layers (maybe a bf16 copy); ``head`` (default ``model``) ranks the top-k."""
    toks, hid, top = [], [], []
    head = head or model
    fast = head is not model
    with torch.inference_mode():
        for i in range(0, len(windows), batch):
            ids = torch.tensor(windows[i : i + batch], dtype=torch.int64)
            h = dense_hidden(model, ids) if isinstance(model, LlamaForCausalLM) else stateful_hidden(model, ids)
            toks.append(ids)
            hid.append(h.to(torch.bfloat16))
            top.append(top_ids(head, h.reshape(-1, h.shape[-1]), fast=fast).view(*ids.shape, -1))
            if bar is not None:
                bar.update(ids.numel())
    return TeacherData(torch.cat(toks), torch.cat(hid).clone(), torch.cat(top).clone())  # clone: no inference tensors


def teacher_generations(
    model: CausalLM,
    prompts: list[list[int]],
    n_new: int,
    batch: int = 128,
    bar: tqdm | None = None,
    head: CausalLM | None = None,
) -> TeacherData:
    """Greedy continuations, ``batch`` prompts in one forward a step (decode reads the weights once per
    step whatever the batch, so a wide step makes more tokens a second)."""
    toks, hid, top = [], [], []
    head = head or model
    for i in range(0, len(prompts), batch):
        generate = greedy_generate if isinstance(model, LlamaForCausalLM) else stateful_generate
        t, h = generate(model, prompts[i : i + batch], n_new)  # type: ignore[arg-type]
        toks.append(t)
        hid.append(h.to(torch.bfloat16))
        top.append(top_ids(head, h.reshape(-1, h.shape[-1]), fast=head is not model).view(*t.shape, -1))
        if bar is not None:
            bar.update(t.numel())
    return TeacherData(torch.cat(toks).clone(), torch.cat(hid).clone(), torch.cat(top).clone())


def teacher_replies(
    model: CausalLM,
    prompts: list[list[int]],
    length: int,
    bar: tqdm | None = None,
    head: CausalLM | None = None,
) -> TeacherData:
    """:func:`teacher_generations` of prompts that may differ in length, each continued to ``length`` tokens: one
    batch run per prompt length (the dense decode needs one), in order of length."""
    by_len: dict[int, list[list[int]]] = {}
    for p in prompts:
        by_len.setdefault(len(p), []).append(p)
    if max(by_len) >= length:
        raise ValueError(f"a prompt of {max(by_len)} tokens leaves nothing to generate in {length}")
    parts = [teacher_generations(model, group, length - n, bar=bar, head=head) for n, group in sorted(by_len.items())]
    return TeacherData.concat(parts)


def build_teacher_data(
    model: CausalLM,
    tokenizer_file: Path,
    plan: DataPlan,
    cache_dir: Path | None,
    target_digest: str,
    progress: bool = True,
    rounds: int = 1,
    gen_rounds: int = 0,
    gen_round_tokens: int = GEN_ROUND_TOKENS,
    chat_rounds: int = 0,
    chat: tuple[str, str] | None = None,
    open_rounds: int = 0,
) -> tuple[TeacherData, TeacherData]:
    """(train, held-out) teacher data of ``rounds`` data rounds (``plan`` and its shifted copies, see
    :attr:`DataPlan.data_round`), then ``gen_rounds`` rounds of ``gen_round_tokens`` tokens of the target's
    own continuations only (no corpus windows; prompts spaced apart from round to round), then ``chat_rounds``
    as many of its replies to chat requests about corpus passages (``chat``: the template's frame,
    :func:`~.data.chat_frame`), then ``open_rounds`` of its replies to open requests (:mod:`.open_requests`),
    each round from ``cache_dir`` when an identical plan was cached before: raising a count computes only the
    new rounds. The held-out data is round 0's."""
    # one copy of the target for every round the cache does not hold, made when the first such round needs it
    teacher = functools.cache(lambda dtype: teacher_model(model, getattr(torch, dtype)))
    plans = [replace(plan, data_round=r) for r in range(rounds)]
    # a generation round's key does not depend on ``rounds``: raising --rounds keeps them cached
    gen = replace(plan, tokens=0, gen_tokens=gen_round_tokens)
    plans += [replace(gen, data_round=r + 1) for r in range(gen_rounds)]
    if (chat_rounds or open_rounds) and chat is None:
        raise ValueError("chat rounds need the target's chat template")
    plans += [replace(gen, prompt_len=CHAT_PROMPT_LEN, chat=chat, data_round=r + 1) for r in range(chat_rounds)]
    plans += [replace(gen, chat=chat, open_requests=True, data_round=r + 1) for r in range(open_rounds)]
    parts = [
        _teacher_round(model, teacher, tokenizer_file, p, cache_dir, target_digest, progress, desc)
        for p, desc in zip(plans, _round_labels(len(plans)))
    ]
    heldout = parts[0][1]
    assert heldout is not None  # round 0 has its held-out part
    return TeacherData.concat([train for train, _ in parts]), heldout


def _round_labels(n: int) -> list[str]:
    """The teacher pass's progress-bar label of each of ``n`` data rounds."""
    return [f"target, round {i + 1}/{n}" for i in range(n)] if n > 1 else ["target"]


def _teacher_round(
    model: CausalLM,
    teacher: Callable[[str], CausalLM],
    tokenizer_file: Path,
    plan: DataPlan,
    cache_dir: Path | None,
    target_digest: str,
    progress: bool,
    desc: str,
) -> tuple[TeacherData, TeacherData | None]:
    """One data round's (train, held-out) teacher data, from the cache or from ``teacher(plan.teacher_dtype)``
    (the target's layers) ranked by ``model``'s float32 head."""
    from tqdm import tqdm

    path = cache_dir / f"teacher-{plan.key(target_digest)}.pt" if cache_dir else None
    if path is not None and path.is_file():
        d = torch.load(path)
        return TeacherData(**d["train"]), TeacherData(**d["heldout"]) if d.get("heldout") else None
    windows, held, prompts = plan.windows(tokenizer_file)
    total = (len(windows) + len(held) + len(prompts)) * plan.seq_len
    layers = teacher(plan.teacher_dtype)
    with tqdm(total=total, desc=desc, unit="tok", disable=not progress, smoothing=0.1) as bar:
        heldout = teacher_windows(layers, held, bar=bar, head=model) if held else None
        parts = [teacher_windows(layers, windows, bar=bar, head=model)] if windows else []
        if prompts:
            parts.append(teacher_replies(layers, prompts, plan.seq_len, bar=bar, head=model))
        train = TeacherData.concat(parts)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"train": vars(train), "heldout": vars(heldout) if heldout else None}, path)
    return train, heldout
