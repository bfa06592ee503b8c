"""The one training loop of every drafter kind: shuffled batches, AdamW with warm-up and cosine decay, gradient
clipping, an optional time limit, and a progress bar with the held-out agreement of the first draft.

What every kind shares is set up here once: its :class:`TrainSettings` (epochs, batch, rate, seed, the
distillation loss's parameters, precision, time limit) and :func:`train_student`, which seeds torch, builds the
student and fits it. What differs between kinds (what is trained, the loss of a batch, how agreement is
measured, a few hyper-parameters) is a :class:`Student`; ``train_mtp`` (:mod:`.mtp`), ``train_eagle``
(:mod:`.eagle`) and ``train_draft`` (:mod:`.draft`) each build one.
"""

from __future__ import annotations

import math
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from .data import TeacherData


@dataclass(frozen=True)
class TrainSettings:
    """One training run's settings, the same for every kind. ``alpha`` and ``n_random``: the distillation
    loss's (:mod:`.losses`); ``bf16``: the forward under bfloat16 autocast (float32 weights and optimizer);
    ``max_seconds``: stop training then (the schedule still ends at a low rate)."""

    epochs: float
    batch: int
    lr: float
    seed: int = 0
    alpha: float = 1.0
    n_random: int = 1024
    bf16: bool = False
    progress: bool = True
    max_seconds: float | None = None
    patience: int = 0  # early stopping: after this many agreement checks without a new best, keep the best; 0: off


class Student(ABC):
    """One kind of drafter as the loop sees it. ``examples``: training examples per epoch (the loop
    draws batches of their indices); ``params``: the trained parameters, all of ``module``'s or some;
    ``probe``: the held-out sequences the progress bar's agreement is measured on (every fourth)."""

    name: str  # the progress bar's label
    weight_decay: float
    warmup: int  # steps of linear warm-up
    evals_per_epoch: int  # held-out agreement checks per epoch (progress bar only)

    def __init__(
        self,
        module: nn.Module,
        params: list[nn.Parameter],
        examples: int,
        train: TeacherData,
        heldout: TeacherData,
        settings: TrainSettings,
    ):
        self.module, self.params, self.examples = module, params, examples
        self.train, self.settings = train, settings
        self.probe = heldout.every(4)

    @abstractmethod
    def loss(self, batch: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """The loss of one batch; ``batch``: example indices; ``gen``: the run's random generator."""

    @abstractmethod
    def agreement(self) -> float:
        """The first draft's agreement with the target on (part of) the held-out data."""

    def report(self) -> str | None:
        """A line of figures printed after every epoch (None: nothing to print)."""
        return None


def _schedule(
    opt: torch.optim.Optimizer,
    lr: float,
    step: int,
    total: int,
    warmup: int = 50,
    elapsed: float = 0.0,
    max_seconds: float | None = None,
) -> None:
    """Linear warm-up, then cosine decay to 5% over the run. The run's progress is the larger of its step
    share and, under a time limit, its time share: a run cut by ``--minutes`` still ends at a low rate
    (before, a time-capped run stopped at its peak rate and kept the noisy weights of that moment)."""
    progress = step / max(1, total)
    if max_seconds:
        progress = max(progress, elapsed / max_seconds)
    scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    for g in opt.param_groups:
        g["lr"] = lr * max(scale, 0.05)


AnyStudent = TypeVar("AnyStudent", bound=Student)


def train_student(make: Callable[[], AnyStudent], settings: TrainSettings) -> AnyStudent:
    """Seeds torch (a new module's random initialisation), builds the student with ``make`` and fits it."""
    torch.manual_seed(settings.seed)
    student = make()
    fit(student, settings)
    return student


class _Best:
    """Early stopping: the module's weights at its best held-out agreement, and the checks since."""

    def __init__(self, student: Student, patience: int, agree: float):
        self.student, self.patience, self.agree, self.since = student, patience, agree, 0
        self.state = self._copy() if patience else None

    def _copy(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.student.module.state_dict().items()}

    def check(self, agree: float) -> bool:
        """Records a check's agreement; True when training should stop."""
        if not self.patience:
            return False
        if agree > self.agree:
            self.agree, self.since, self.state = agree, 0, self._copy()
            return False
        self.since += 1
        return self.since >= self.patience

    def restore(self) -> None:
        if self.state is not None:
            self.student.module.load_state_dict(self.state)


def fit(student: Student, settings: TrainSettings) -> None:
    """Trains ``student`` for ``settings.epochs`` passes over its examples (or until ``settings.max_seconds``, or
    ``settings.patience`` checks without a better held-out agreement: then the best weights are kept), printing
    the student's :meth:`Student.report` after every epoch; then leaves its module in eval mode without gradients."""
    from tqdm import tqdm

    epochs, batch, lr, seed = settings.epochs, settings.batch, settings.lr, settings.seed
    progress, max_seconds = settings.progress, settings.max_seconds
    n = student.examples
    if n < batch:
        raise ValueError(f"{n} training examples do not fill one batch of {batch}: more data or a smaller batch")
    steps_per_epoch = max(1, n // batch)
    total = max(1, int(epochs * steps_per_epoch))
    eval_every = max(1, steps_per_epoch // student.evals_per_epoch)
    opt = torch.optim.AdamW(student.params, lr=lr, weight_decay=student.weight_decay, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(seed)
    t0 = time.monotonic()
    bar = tqdm(total=total, desc=student.name, unit="step", disable=not progress)
    agree = student.agreement()
    _report(student, bar, "before training")
    best = _Best(student, settings.patience, agree)
    step = epoch = 0
    while step < total:
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n - batch + 1, batch):
            if step >= total or (max_seconds and time.monotonic() - t0 > max_seconds):
                step = total
                break
            student.module.train()
            loss = student.loss(perm[i : i + batch], gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.params, 1.0)
            _schedule(
                opt, lr, step, total, warmup=student.warmup, elapsed=time.monotonic() - t0, max_seconds=max_seconds
            )
            opt.step()
            step += 1
            if step % eval_every == 0 or step == total:
                student.module.eval()
                agree = student.agreement()
                if best.check(agree):
                    best.restore()
                    bar.write(f"early stop at step {step}: no better held-out agreement than {best.agree:.3f}")
                    step = total
                    break
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", heldout_agree=f"{agree:.3f}")
            bar.update(1)
        epoch += 1
        _report(student, bar, f"epoch {epoch}")
    bar.close()
    best.restore()
    student.module.eval()
    student.module.requires_grad_(False)


def _report(student: Student, bar, label: str) -> None:
    student.module.eval()
    line = student.report()
    if line:
        bar.write(f"{label}: {line}", file=sys.stderr)
