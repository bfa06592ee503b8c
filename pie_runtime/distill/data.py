"""The training data of drafter distillation: where the corpus is, how a corpus file becomes token windows
(its last 5% held out), the plan of what to build (and its cache key), and :class:`TeacherData`, the token
sequences with the target's view of them that training and evaluation read.

Training data: windows of the corpus (teacher-forced) and, optionally, the target's own greedy
continuations of corpus prompts, which are what a drafter sees when serving (see :mod:`.teacher`), its
replies in its chat template to requests about corpus passages, and its replies to open requests with no
passage (:mod:`.open_requests`): what a drafter sees serving a chat.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .open_requests import TEMPLATES, TOPICS, open_requests

if TYPE_CHECKING:
    from ..models.checkpoint import TokenizerInfo

TOP_K = 8  # target top-k ids cached per position (the candidate set's core)
HELDOUT_FRACTION = 0.05  # the last 5% of every corpus file is never trained on
CHAT_PROMPT_LEN = 96  # tokens of a chat-round prompt: the template's frame, a request and a corpus passage
# what a chat round asks about each passage, in turn (the passage follows the request after a blank line)
CHAT_REQUESTS = (
    "Summarize this passage in a few sentences.",
    "What happens in this passage?",
    "Rewrite this passage in plain modern English.",
    "Continue this story.",
    "Explain this passage to a child.",
    "Who is in this passage, and what do they want?",
    "Write a short poem inspired by this passage.",
    "What is the main idea of this text?",
    "Answer in one word: is this passage happy or sad? Then explain why.",
    "List three questions a reader might ask about this passage.",
)
GEN_ROUND_TOKENS = 262_144  # tokens of one generation-only data round (`pie drafter train --gen-rounds`)
CORPUS_ENV = "PIE_CORPUS_DIR"  # a folder holding the corpus files (austen.txt, kjv.txt)
REPO_ROOT = Path(__file__).resolve().parents[2]


def corpus_folders() -> list[Path]:
    """Where :func:`find_corpus` looks, in order: ``$PIE_CORPUS_DIR`` (when set), then ``shared/corpus/``
    beside the repository's root."""
    folders = [REPO_ROOT.parent / "shared" / "corpus"]
    if env := os.environ.get(CORPUS_ENV):
        folders.insert(0, Path(env).expanduser())
    return folders


def find_corpus(name: str = "austen.txt") -> Path | None:
    """The corpus file ``name`` from the first of :func:`corpus_folders` that holds it; None when none does
    (tests skip, naming the folders searched)."""
    for folder in corpus_folders():
        if (folder / name).is_file():
            return folder / name
    return None


@dataclass
class TeacherData:
    """Sequences with the target's view of them: every position's final hidden state and top-k ids."""

    tokens: torch.Tensor  # (S, T) int64
    hidden: torch.Tensor  # (S, T, H) bfloat16, final normed hidden
    top: torch.Tensor  # (S, T, TOP_K) int32; top[..., 0] is the target's greedy next token

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    @staticmethod
    def concat(parts: Sequence[TeacherData]) -> TeacherData:
        """The sequences of every part, in order, joined with one copy."""
        return TeacherData(
            torch.cat([p.tokens for p in parts]),
            torch.cat([p.hidden for p in parts]),
            torch.cat([p.top for p in parts]),
        )

    def every(self, k: int) -> TeacherData:
        """Every ``k``-th sequence (the training progress bar's probe of the held-out data)."""
        return TeacherData(self.tokens[::k], self.hidden[::k], self.top[::k])

    def from_position(self, start: int) -> TeacherData:
        """Every sequence from position ``start`` on."""
        return TeacherData(self.tokens[:, start:], self.hidden[:, start:], self.top[:, start:])


def corpus_tokens(tokenizer_file: Path, corpus: Path) -> tuple[list[int], list[int]]:
    """(train ids, held-out ids) of one corpus file: the held-out part is its last 5% of characters."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    text = Path(corpus).read_text(encoding="utf-8", errors="replace")
    cut = int(len(text) * (1 - HELDOUT_FRACTION))
    cut = text.rfind("\n", 0, cut) + 1 or cut
    return tok.encode(text[:cut]).ids, tok.encode(text[cut:]).ids


def spaced_windows(ids: list[int], n: int, length: int, phase: float = 0.0) -> list[list[int]]:
    """``n`` windows of ``length`` tokens spread evenly over ``ids`` (whole corpus, not its first pages).
    ``phase`` in [0, 1) shifts every start by that fraction of the spacing (windows past the end are dropped):
    a later data round's windows fall between the earlier rounds'."""
    room = len(ids) - length
    if n <= 0 or room < 0:
        return []
    starts = [round((i + phase) * room / (n - 1)) for i in range(n)] if n > 1 else [round(phase * room)]
    return [ids[s : s + length] for s in starts if s <= room]


def round_phase(r: int) -> float:
    """Data round ``r``'s shift as a fraction of the window spacing: 0, 1/2, 1/4, 3/4, 1/8, ... (the van der
    Corput sequence), so each round's windows fall in the largest gaps the rounds before left."""
    phase, scale = 0.0, 0.5
    while r:
        phase += scale * (r & 1)
        r, scale = r >> 1, scale / 2
    return phase


@dataclass
class DataPlan:
    """What :func:`~.teacher.build_teacher_data` builds; ``key`` names its cache file."""

    corpora: list[Path]
    tokens: int  # corpus tokens to train on (split evenly across corpora)
    gen_tokens: int  # tokens of the target's own greedy continuations (prompts included)
    seq_len: int = 256
    heldout_tokens: int = 2048  # per corpus, teacher-forced, for the progress bar
    prompt_len: int = 32
    teacher_dtype: str = "float32"  # the teacher pass's weights: float32 (exact) or bfloat16 (fast)
    data_round: int = 0  # round r > 0: windows and prompts shifted by round_phase(r), no held-out part
    # (text before, text after) a user message's content in the target's chat template, its assistant turn
    # opened (:func:`chat_frame`): the generation prompts are then chat requests about corpus passages
    chat: tuple[str, str] | None = None
    # with ``chat``: the prompts are open requests (:mod:`.open_requests`, no passage), of varying length, each
    # continued to ``seq_len`` tokens
    open_requests: bool = False

    def key(self, target_digest: str) -> str:
        files = [(str(Path(c).resolve()), Path(c).stat().st_size) for c in self.corpora]
        blob = json.dumps(
            [
                target_digest,
                files,
                self.tokens,
                self.gen_tokens,
                self.seq_len,
                self.heldout_tokens,
                self.prompt_len,
                TOP_K,
                HELDOUT_FRACTION,
                1,
            ]
            + ([self.teacher_dtype] if self.teacher_dtype != "float32" else [])
            + ([f"round{self.data_round}"] if self.data_round else [])  # round 0 keeps the keys cached before
            + ([list(self.chat), list(CHAT_REQUESTS)] if self.chat else [])
            + (["open", list(TEMPLATES), list(TOPICS)] if self.open_requests else [])
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def windows(self, tokenizer_file: Path) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """(training windows, held-out windows, generation prompts) over every corpus, each window
        ``seq_len`` tokens; the prompts are ``prompt_len`` tokens. A later round (``data_round`` > 0) has
        no held-out windows: the held-out data is round 0's."""
        if self.open_requests:
            if self.chat is None:
                raise ValueError("open requests need the target's chat frame")
            n = self.gen_tokens // self.seq_len
            return [], [], chat_prompts(tokenizer_file, self.chat, open_requests(n, n * max(0, self.data_round - 1)))
        splits = [corpus_tokens(tokenizer_file, c) for c in self.corpora]
        per = self.tokens // self.seq_len // len(splits)
        n_held = 0 if self.data_round else max(1, self.heldout_tokens // self.seq_len)
        n_gen = self.gen_tokens // self.seq_len // len(splits)
        phase = round_phase(self.data_round)
        windows, held, prompts = [], [], []
        for train_ids, held_ids in splits:
            # corpus windows and generation prompts come from disjoint halves of each window slot
            windows += spaced_windows(train_ids, per, self.seq_len, phase)
            held += spaced_windows(held_ids, n_held, self.seq_len)
            starts = spaced_windows(train_ids, n_gen, self.seq_len + 97, phase)
            if self.chat:
                prompts += chat_requests(tokenizer_file, self.chat, starts, self.prompt_len, len(prompts))
            else:
                prompts += [w[-self.prompt_len :] for w in starts]
        return windows, held, prompts


def chat_frame(render: Callable[[list[dict]], str]) -> tuple[str, str]:
    """(text before, text after) a user message's content as ``render`` (a chat template with its
    generation prompt) frames it."""
    before, _, after = render([{"role": "user", "content": "\x00"}]).partition("\x00")
    return before, after


def model_chat_frame(tokenizer_file: Path, info: TokenizerInfo) -> tuple[str, str]:
    """:func:`chat_frame` of a stored model's chat template (ValueError when it has none)."""
    from inferlet.tokenizer import Tokenizer

    if not info.chat_template:
        raise ValueError("the model has no chat template")
    tok = Tokenizer(
        Path(tokenizer_file).read_text(),
        info.eos_token_ids,
        info.bos_token_id,
        info.chat_template,
        add_bos_token=info.add_bos_token,
        add_eos_token=info.add_eos_token,
    )
    return chat_frame(tok.chat)


def chat_requests(
    tokenizer_file: Path, frame: tuple[str, str], windows: list[list[int]], length: int, first: int = 0
) -> list[list[int]]:
    """One chat prompt of exactly ``length`` tokens per corpus window: the frame around a request
    (:data:`CHAT_REQUESTS` in turn, from the ``first``-th) and the end of the window's text, cut to fit."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    after = tok.encode(frame[1], add_special_tokens=False).ids
    befores = [tok.encode(f"{frame[0]}{request}\n\n", add_special_tokens=False).ids for request in CHAT_REQUESTS]
    room = [length - len(before) - len(after) for before in befores]
    if min(room) < 8:
        raise ValueError(f"a chat prompt of {length} tokens leaves {min(room)} for the passage: the template is longer")
    prompts = []
    for i, w in enumerate(windows):
        r = (first + i) % len(CHAT_REQUESTS)
        prompts.append(befores[r] + w[-room[r] :] + after)
    return prompts


def chat_prompts(tokenizer_file: Path, frame: tuple[str, str], requests: Sequence[str]) -> list[list[int]]:
    """Each request as a user message in ``frame`` (the template's text before and after it), as token ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    return [tok.encode(f"{frame[0]}{r}{frame[1]}", add_special_tokens=False).ids for r in requests]
