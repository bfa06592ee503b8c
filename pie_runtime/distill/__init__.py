"""Self-distillation of drafters from a frozen target (``pie drafter train``).

Labels are the target's own predictions, never the corpus's next words: the target's final hidden state and
top-k ids at every training position are computed once (the teacher pass), and the student (an MTP head or a
few-layer draft model) is trained to reproduce the target's distribution there. The modules, in the order a
run uses them:

- :mod:`.data`: finding the corpus, corpus windows (the last 5% of each file held out), the data plan and
  :class:`TeacherData`;
- :mod:`.dense`: the model's dense forward (plain causal attention over (B, T) batches) for the teacher pass
  and training; the engine's paged forward is for serving;
- :mod:`.teacher`: the teacher pass and its cache (bfloat16 where the CPU is fast at it);
- :mod:`.losses`: the loss (KL over a candidate set plus a hidden-state term);
- :mod:`.loop`: the one training set-up (:class:`~.loop.TrainSettings`) and loop, over a :class:`~.loop.Student`
  that says what a kind trains;
- :mod:`.mtp`, :mod:`.eagle`, :mod:`.draft`: the three kinds (``train_mtp``, ``train_eagle``, ``train_draft``);
- :mod:`.agreement`: held-out acceptance rates per draft position.

Precision (``--precision``, default bf16 on CPUs with bf16 units): the teacher pass runs a bfloat16 copy of
the target (its top-k re-ranked with the float32 head) and training runs under bfloat16 autocast with
float32 weights and optimizer state: several times more data and steps per CPU minute than float32, which is
what took the drafters past their aims, for a few greedy labels in a thousand that differ from the float32
target's (docs/performance.md, "Drafter training").
"""

from ..models.cpu import bf16_is_fast
from .agreement import draft_agreement, follows_greedy, mtp_agreement
from .data import (
    CHAT_PROMPT_LEN,
    CHAT_REQUESTS,
    CORPUS_ENV,
    GEN_ROUND_TOKENS,
    HELDOUT_FRACTION,
    TOP_K,
    DataPlan,
    TeacherData,
    chat_frame,
    chat_prompts,
    chat_requests,
    corpus_folders,
    corpus_tokens,
    find_corpus,
    model_chat_frame,
    spaced_windows,
)
from .dense import dense_hidden, dense_layer, greedy_generate
from .draft import draft_from_target, train_draft
from .loop import TrainSettings
from .losses import candidates, distill_loss
from .mtp import train_mtp
from .open_requests import open_requests
from .teacher import (
    build_teacher_data,
    teacher_generations,
    teacher_model,
    teacher_replies,
    teacher_windows,
    top_ids,
)

__all__ = [
    "CHAT_PROMPT_LEN",
    "CHAT_REQUESTS",
    "CORPUS_ENV",
    "GEN_ROUND_TOKENS",
    "HELDOUT_FRACTION",
    "TOP_K",
    "DataPlan",
    "TeacherData",
    "TrainSettings",
    "bf16_is_fast",
    "build_teacher_data",
    "chat_frame",
    "chat_prompts",
    "chat_requests",
    "candidates",
    "corpus_folders",
    "corpus_tokens",
    "dense_hidden",
    "dense_layer",
    "distill_loss",
    "draft_agreement",
    "draft_from_target",
    "find_corpus",
    "follows_greedy",
    "greedy_generate",
    "model_chat_frame",
    "mtp_agreement",
    "open_requests",
    "spaced_windows",
    "teacher_generations",
    "teacher_model",
    "teacher_replies",
    "teacher_windows",
    "top_ids",
    "train_draft",
    "train_mtp",
]
