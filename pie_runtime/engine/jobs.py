"""What the engine core holds per model and per fire: a served model (runner, page pool, fire queue), a
fire waiting in that queue or partly run (chunked prefill), and the step counters behind ``stats``."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..protocol import messages as m
from .channels import Channel
from .page_pool import PagePool
from .programs import Program
from .programs.fire import RunState
from .runner import ModelRunner
from .working_set import WorkingSet

Reply = tuple[bytes, dict]  # (client identity, reply map)


@dataclass
class ServedModel:
    name: str
    info: m.ModelInfo
    runner: ModelRunner
    pool: PagePool
    tokenizer_json: str
    queue: deque[FireJob] = field(default_factory=deque)


@dataclass
class FireJob:
    client: bytes
    req_id: int
    ws: WorkingSet
    tokens: list[int]
    positions: list[int]
    readouts: list[m.Readout]
    masks: list[np.ndarray | None]
    fold: int | None  # None: deferred
    start: int  # sequence index of the first row
    done: int = 0  # rows already run
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # window row → final hidden state
    program: Program | None = None
    bindings: list[Channel] = field(default_factory=list)
    source: Channel | None = None  # tokens come from this channel's front cell, taken when the fire runs
    run: RunState | None = None

    @property
    def writes(self) -> list[Channel]:
        return [self.bindings[s] for s in sorted(self.program.writes)] if self.program else []

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done


@dataclass
class StepStats:
    steps: int = 0
    rows: int = 0
    fires: int = 0
    forward_s: float = 0.0
    epilogue_s: float = 0.0
    step_s: float = 0.0
