"""Training a draft model: a few-layer copy of the target (some of its layers, with copies of its embedding,
head and final norm; the embedding and head stay frozen), distilled over whole sequences with the dense
forward."""

from __future__ import annotations

import torch

from ..models.llama import LlamaForCausalLM
from .agreement import draft_agreement
from .data import TeacherData
from .dense import dense_hidden
from .loop import Student, TrainSettings, train_student
from .losses import candidates, distill_loss


def draft_from_target(target: LlamaForCausalLM, layers: list[int]) -> LlamaForCausalLM:
    """A small model with the target's config but only ``layers`` (copied, renumbered), its embedding, head
    and final norm: the starting point of a distilled draft model."""
    from ..store import build_model

    n = len(target.model.layers)
    layers = [i % n for i in layers]
    cfg = target.config.model_copy(update={"num_hidden_layers": len(layers)})
    src = target.state_dict()
    state = {k: v for k, v in src.items() if not k.startswith("model.layers.")}
    for new, old in enumerate(layers):
        prefix = f"model.layers.{old}."
        state |= {f"model.layers.{new}.{k[len(prefix) :]}": v for k, v in src.items() if k.startswith(prefix)}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    draft = build_model(cfg, {k: v.clone().float() for k, v in state.items()}, torch.float32, "cpu")
    assert isinstance(draft, LlamaForCausalLM)
    return draft


class DraftStudent(Student):
    """An example is a whole training sequence; its layers and final norm are trained."""

    name, weight_decay, warmup, evals_per_epoch = "draft", 0.0, 20, 2

    def __init__(self, draft: LlamaForCausalLM, train: TeacherData, heldout: TeacherData, settings: TrainSettings):
        trainable = [p for n, p in draft.named_parameters() if n.startswith(("model.layers.", "model.norm."))]
        for p in trainable:
            p.requires_grad_(True)
        super().__init__(draft, trainable, train.tokens.shape[0], train, heldout, settings)
        self.draft = draft

    def loss(self, batch: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        settings = self.settings
        head_w = self.draft.lm_head.weight.detach()
        cand = candidates(self.train.top[batch], self.draft.config.vocab_size, settings.n_random, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            h = dense_hidden(self.draft, self.train.tokens[batch]).reshape(-1, head_w.shape[1])
            teacher_h = self.train.hidden[batch].reshape(-1, head_w.shape[1])
            return distill_loss(h, teacher_h, head_w, cand, settings.alpha)

    def agreement(self) -> float:
        return draft_agreement(self.draft, self.probe)[0]


def train_draft(
    target: LlamaForCausalLM, train: TeacherData, heldout: TeacherData, settings: TrainSettings, *, layers: list[int]
) -> LlamaForCausalLM:
    """Distills a few-layer copy of the target (shared embedding and head stay frozen)."""
    return train_student(
        lambda: DraftStudent(draft_from_target(target, layers), train, heldout, settings), settings
    ).draft
