"""What the engine holds per fire: a fire waiting in its model's queue or partly run (chunked prefill), the
typed outcome of executing it, and the step counters behind ``stats``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..protocol import PieError
from ..protocol import messages as m
from ..protocol.tree import Fold
from .channels import Channel, Txn
from .programs import Program
from .programs.fire import RunState
from .working_set import TreeWindow, WorkingSet

Reply = tuple[bytes, dict]  # (client identity, reply map)
Handler = Callable[[bytes, Any], dict | None]  # (client, the op's request model) → its reply; None: a step's


@dataclass(kw_only=True)
class FireJob:
    client: bytes
    req_id: int
    ws: WorkingSet
    tokens: list[int]  # empty until a channel-fed fire takes its window
    positions: list[int]
    readouts: list[m.Readout]
    masks: list[np.ndarray | None]  # one per readout: its packed allowed-token bitmask
    fold: Fold | None  # a count or a path (protocol.tree); None: deferred
    start: int  # sequence index of the first row
    parents: list[int] | None = None  # a tree window's parent rows (protocol.tree); None: a chain
    done: int = 0  # rows already run
    cached_rows: int = 0  # leading rows mapped from the prefix cache instead of run (counted in done)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # window row → final hidden state
    # (readout index, window row) → an attention readout's mass at that row (models/attention_scores.py)
    scores: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    program: Program | None = None
    bindings: list[Channel] = field(default_factory=list)
    source: Channel | None = None  # tokens come from this channel's front cell, taken when the fire runs
    run: RunState | None = None
    readout_bytes: int = 0  # its readouts' replies (identities.readout_bytes), charged to its client's identity

    @property
    def tree(self) -> TreeWindow | None:
        return TreeWindow(tuple(self.parents), tuple(self.tokens)) if self.parents is not None else None

    @property
    def writes(self) -> list[Channel]:
        return [self.bindings[s] for s in sorted(self.program.writes)] if self.program else []

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done

    @property
    def readout_rows(self) -> int:
        return sum(len(r.rows) for r in self.readouts)


@dataclass
class FireOutcome:
    """What executing a finished fire gave: its readout results and, with an epilogue, the fold the program
    chose and the channel transaction it committed; or the error that failed it (then none of it applies)."""

    job: FireJob
    results: list[dict[str, np.ndarray]] = field(default_factory=list)  # one per readout; {} for no rows
    device_fold: list[int] | None = None  # the path the epilogue folds (checked), when it folds
    txn: Txn | None = None
    error: PieError | None = None


@dataclass
class StepStats:
    steps: int = 0
    rows: int = 0
    fires: int = 0
    forward_s: float = 0.0
    epilogue_s: float = 0.0
    step_s: float = 0.0
