"""Training an MTP head (:mod:`pie_runtime.models.mtp`): one module reused ``depth`` times, each step
teacher-forced on the data's token and distilled against the target's hidden state at that position."""

from __future__ import annotations

import torch

from ..models.families import CausalLM, final_norm, norm_eps
from ..models.mtp import MTPConfig, MTPHead, MTPModule
from .agreement import mtp_agreement
from .data import TeacherData
from .loop import Student, TrainSettings, train_student
from .losses import candidates, distill_loss


class MTPStudent(Student):
    """An example is a (sequence, start position) with targets up to ``depth`` positions after it. Step j
    takes the previous step's output hidden and the data's token t+j; its loss (weight 0.5^(j-1): later
    steps matter less, acceptance is a prefix) is against the target at position t+j."""

    name, weight_decay, warmup, evals_per_epoch = "mtp", 0.01, 50, 4

    def __init__(
        self,
        module: MTPModule,
        target: CausalLM,
        train: TeacherData,
        heldout: TeacherData,
        settings,
        reports: dict[str, TeacherData] | None = None,
    ):
        depth = module.config.depth
        s, t = train.tokens.shape
        n = t - depth  # start positions with targets up to t+depth
        self.rows = torch.arange(s).repeat_interleave(n), torch.arange(n).repeat(s)
        super().__init__(module, list(module.parameters()), len(self.rows[0]), train, heldout, settings)
        self.target, self.depth = target, depth
        self.head = MTPHead(module, target)
        self.weights = [0.5**j for j in range(depth)]
        self.reports = reports or {}
        if reports:  # a small held-out chat set: the progress bar and early stopping read all of it
            self.probe = heldout

    def loss(self, batch: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        data, target, settings = self.train, self.target, self.settings
        head_w, norm, embed = target.lm_head.weight.detach(), final_norm(target), target.embed
        si, ti = self.rows[0][batch], self.rows[1][batch]
        h = data.hidden[si, ti].float()
        loss = torch.zeros(())
        top = torch.stack([data.top[si, ti + j] for j in range(1, self.depth + 1)])
        cand = candidates(top, target.config.vocab_size, settings.n_random, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            for j in range(1, self.depth + 1):
                e = embed(data.tokens[si, ti + j]).detach()
                h = norm(self.module(h, e))
                teacher = data.hidden[si, ti + j]
                loss = loss + self.weights[j - 1] * distill_loss(h, teacher, head_w, cand, settings.alpha)
        return loss

    def agreement(self) -> float:
        return mtp_agreement(self.head, self.probe, 1)[0]

    def report(self) -> str | None:
        """The acceptance rate by draft position on each of ``reports``' held-out sets."""
        if not self.reports:
            return None
        parts = []
        for name, data in self.reports.items():
            agree = mtp_agreement(self.head, data, self.depth, conditional=True)
            parts.append(f"{name} " + "/".join(f"{a:.3f}" for a in agree))
        return "held-out acceptance by position: " + ", ".join(parts)


def train_mtp(
    target: CausalLM,
    train: TeacherData,
    heldout: TeacherData,
    settings: TrainSettings,
    *,
    depth: int,
    target_name: str,
    target_digest: str,
    intermediate: int | None = None,
    blocks: int = 2,
    init: MTPModule | None = None,
    reports: dict[str, TeacherData] | None = None,
) -> MTPModule:
    """Trains one MTP module reused ``depth`` times (step j: the previous step's output hidden and the
    data's token, teacher-forced; each step's loss against the target at that position); ``settings.bf16``
    makes more steps a CPU minute. ``init``: continue training this module (its blocks,
    width and depth win over the arguments). ``reports``: held-out sets whose acceptance by position is printed
    after every epoch."""
    cfg = target.config

    def make() -> MTPStudent:
        if init is not None:
            module = init.float().requires_grad_(True)
        else:
            module = MTPModule(
                MTPConfig(
                    hidden_size=cfg.hidden_size,
                    intermediate_size=intermediate or cfg.intermediate_size,
                    num_blocks=blocks,
                    depth=depth,
                    vocab_size=cfg.vocab_size,
                    rms_norm_eps=norm_eps(cfg),
                    target=target_name,
                    target_digest=target_digest,
                )
            )
        return MTPStudent(module, target, train, heldout, settings, reports)

    return train_student(make, settings).head.module
