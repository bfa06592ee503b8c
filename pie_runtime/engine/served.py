"""The models an engine serves: each with its runner, its KV pages, its recurrent-state slots (models with
recurrent state) and its queue of accepted fires.

A model's queue holds fires oldest first; a working set's fires run in submission order, and a fire counts
toward its working set's ``in_flight`` from acceptance until it is answered (or dropped with the set).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..protocol import ErrorCode, PieError
from ..protocol import messages as m
from ..protocol.tree import fold_count
from .channels import Channel
from .jobs import FireJob
from .kv_pages import KVPages
from .runner import ModelRunner
from .scheduler import heads
from .state_slots import StateSlots
from .working_set import WorkingSet


class FireQueue:
    def __init__(self) -> None:
        self._jobs: deque[FireJob] = deque()

    def __iter__(self) -> Iterator[FireJob]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def push(self, job: FireJob) -> None:
        job.ws.in_flight += 1
        if job.fold is None:
            job.ws.pending_fold = len(job.positions)  # refuses the next fire from now on
            job.ws.pending_tree = job.tree
        self._jobs.append(job)

    def pop(self, job: FireJob) -> None:
        """Takes an answered fire out of the queue."""
        self._jobs.remove(job)
        job.ws.in_flight -= 1

    def drop(self, ws: WorkingSet) -> list[FireJob]:
        """Takes every fire of ``ws`` out of the queue unanswered; returns them."""
        dropped = [fire for fire in self._jobs if fire.ws is ws]
        self._jobs = deque(fire for fire in self._jobs if fire.ws is not ws)
        ws.in_flight = 0
        return dropped

    def heads(self) -> list[FireJob]:
        return heads(self._jobs)

    def planned_length(self, ws: WorkingSet) -> int:
        """Committed length of ``ws`` once every queued fire of it has folded (queued fires never defer)."""
        return ws.committed + sum(
            fold_count(fire.fold) for fire in self._jobs if fire.ws is ws and fire.fold is not None
        )


@dataclass
class ServedModel:
    name: str
    info: m.ModelInfo
    runner: ModelRunner
    pages: KVPages
    tokenizer_json: str
    queue: FireQueue = field(default_factory=FireQueue)
    states: StateSlots | None = None  # the recurrent-state slots (models with recurrent state only)
    pass_costs_from: str = ""  # how info.pass_cost_ms was had: "measured" or "reused, ..." (pass_cost_cache.py)


class ServedModels:
    """The served models by name (the first is the default), and questions about all their queued fires."""

    def __init__(self, models: list[ServedModel]):
        if not models:
            raise ValueError("an engine serves at least one model")
        self._by_name = {served.name: served for served in models}
        self.default = models[0].name

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._by_name.values())

    def __getitem__(self, name: str) -> ServedModel:
        return self._by_name[name]

    def get(self, name: str | None) -> ServedModel:
        served = self._by_name.get(name or self.default)
        if served is None:
            raise PieError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r}; serving {', '.join(self._by_name)}")
        return served

    def jobs(self) -> Iterator[FireJob]:
        return (fire for served in self for fire in served.queue)

    def writes(self, ch: Channel) -> bool:
        """Whether a queued fire's epilogue writes ``ch``."""
        return any(c is ch for fire in self.jobs() for c in fire.writes)

    def uses(self, ch: Channel) -> bool:
        """Whether a queued fire reads or writes ``ch``."""
        return any(ch is fire.source or any(c is ch for c in fire.bindings) for fire in self.jobs())
