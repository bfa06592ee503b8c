"""The seeded chat prompt set of `pie drafter data`: requests a user might send, built from templates over corpus
passages (questions, summaries, continuations, rewrites, lists, code-like requests) and over topics (open
requests, no passage), split into training and held-out prompts.

Held-out prompts share nothing with training prompts but the corpus files: their passages come from the held-out
last 5% of each corpus (:data:`~.data.HELDOUT_FRACTION`), their templates from :data:`HELDOUT_TEMPLATES` (never
used for training) and their topics from the held-out topics of :mod:`.open_requests`. The same seed and corpora
give the same prompts in the same order, so a resumed run answers the prompts the first run did not reach.
"""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from .data import HELDOUT_FRACTION
from .open_requests import HELDOUT_EVERY, TEMPLATES, TOPICS

# (kind, template): {p} is a corpus passage
PASSAGE_TEMPLATES = (
    ("question", "What is happening in this passage?\n\n{p}"),
    ("question", "{p}\n\nWho are the people in this text, and what do they want?"),
    ("question", "Read this and answer: what is the main idea?\n\n{p}"),
    ("summary", "Summarize this passage in two sentences.\n\n{p}"),
    ("summary", "Give a one-paragraph summary of the following text.\n\n{p}"),
    ("continuation", "Continue this story for a few sentences.\n\n{p}"),
    ("continuation", "{p}\n\nWhat might happen next? Write the next paragraph."),
    ("rewrite", "Rewrite this passage in plain modern English.\n\n{p}"),
    ("rewrite", "Rewrite this text as a short news report.\n\n{p}"),
    ("list", "List the characters and objects mentioned in this passage.\n\n{p}"),
    ("list", "Make a bulleted list of the key points of this text.\n\n{p}"),
    ("code", "Write a Python function that counts the words in a text like this one:\n\n{p}"),
    ("code", "Turn the facts in this passage into a JSON object.\n\n{p}"),
)
# (kind, template): {t} is a topic
TOPIC_TEMPLATES = (
    ("code", "Write a Python function related to {t}, with a docstring."),
    ("code", "Write a small Python class that models {t}."),
    ("list", "List five facts about {t}."),
    ("question", "What are the most important things to know about {t}?"),
)
# never used for training prompts: {p} passage, {t} topic
HELDOUT_TEMPLATES = (
    ("question", "In a few sentences, explain what this text is about:\n\n{p}"),
    ("summary", "Sum up this passage for someone in a hurry.\n\n{p}"),
    ("rewrite", "Say the same thing as this passage in simpler words.\n\n{p}"),
    ("list", "Write three bullet points about {t}."),
    ("question", "How would you describe {t} to a friend?"),
    ("code", "Write a short Python script that prints a fact about {t}."),
    ("question", "Tell me something surprising about {t}, in plain words."),
)
PASSAGE_WORDS = (25, 70)  # a passage is a run of this many words, cut at a sentence end where one falls
HELDOUT_OPEN_SHARE = 0.5  # of the held-out prompts, this share are open requests (about a topic, no passage)


class ChatPrompt(BaseModel):
    """One request of the set: ``id`` is stable across runs of the same seed and corpora."""

    id: str
    split: Literal["train", "heldout"]
    kind: str  # question, summary, continuation, rewrite, list, code, open
    text: str


def _passages(corpus: Path, heldout: bool, n: int, rng: random.Random) -> list[str]:
    """``n`` passages of :data:`PASSAGE_WORDS` words from the corpus's training part (its first 95%) or its
    held-out part, at seeded places."""
    text = corpus.read_text(encoding="utf-8", errors="replace")
    cut = int(len(text) * (1 - HELDOUT_FRACTION))
    cut = text.rfind("\n", 0, cut) + 1 or cut
    words = (text[cut:] if heldout else text[:cut]).split()
    lo, hi = PASSAGE_WORDS
    out = []
    for _ in range(n):
        start = rng.randrange(0, max(1, len(words) - hi))
        chunk = " ".join(words[start : start + rng.randint(lo, hi)])
        end = max(chunk.rfind(". "), chunk.rfind("? "), chunk.rfind("! "))
        out.append(chunk[: end + 1] if end > len(chunk) // 2 else chunk)
    return [re.sub(r"\s+", " ", p).strip() for p in out]


def _topics(heldout: bool) -> list[str]:
    return [t for i, t in enumerate(TOPICS) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == heldout]


def _prompt(split: str, kind: str, text: str) -> ChatPrompt:
    digest = hashlib.sha256(f"{split}\x00{text}".encode()).hexdigest()[:12]
    return ChatPrompt(id=f"{split[0]}-{digest}", split=split, kind=kind, text=text)  # type: ignore[arg-type]


def training_prompts(corpora: list[Path], n: int, seed: int = 0) -> list[ChatPrompt]:
    """``n`` training requests, seeded: a third open requests (:data:`~.open_requests.TEMPLATES` and
    :data:`TOPIC_TEMPLATES` over the training topics), the rest :data:`PASSAGE_TEMPLATES` over passages of the
    corpora's training parts, shuffled together."""
    rng = random.Random(seed)
    n_open = n // 3
    per = -(-(n - n_open) // len(corpora))
    passages = [p for c in corpora for p in _passages(c, False, per, rng)][: n - n_open]
    prompts = [
        _prompt("train", kind, template.format(p=p))
        for p, (kind, template) in zip(passages, (rng.choice(PASSAGE_TEMPLATES) for _ in passages))
    ]
    opens = [("open", t) for t in TEMPLATES] + list(TOPIC_TEMPLATES)
    topics = _topics(False)
    for _ in range(n_open):
        kind, template = rng.choice(opens)
        prompts.append(_prompt("train", kind, template.replace("{t}", "{}").format(rng.choice(topics))))
    rng.shuffle(prompts)
    return _unique(prompts)


def heldout_prompts(corpora: list[Path], n: int, seed: int = 0) -> list[ChatPrompt]:
    """``n`` held-out requests, seeded: :data:`HELDOUT_TEMPLATES` over passages of the corpora's held-out parts
    and over the held-out topics."""
    rng = random.Random(seed + 1_000_003)
    passage_t = [t for t in HELDOUT_TEMPLATES if "{p}" in t[1]]
    topic_t = [t for t in HELDOUT_TEMPLATES if "{t}" in t[1]]
    n_open = round(n * HELDOUT_OPEN_SHARE)
    per = -(-(n - n_open) // len(corpora))
    passages = [p for c in corpora for p in _passages(c, True, per, rng)][: n - n_open]
    prompts = [
        _prompt("heldout", k, t.format(p=p)) for p, (k, t) in zip(passages, (rng.choice(passage_t) for _ in passages))
    ]
    pairs = [(kind, template, topic) for kind, template in topic_t for topic in _topics(True)]
    rng.shuffle(pairs)  # each (template, topic) once
    prompts += [_prompt("heldout", kind, template.format(t=topic)) for kind, template, topic in pairs[:n_open]]
    return _unique(prompts)


def _unique(prompts: list[ChatPrompt]) -> list[ChatPrompt]:
    """``prompts`` without repeats (a repeated text has the same id), in order."""
    seen: set[str] = set()
    return [p for p in prompts if not (p.id in seen or seen.add(p.id))]
