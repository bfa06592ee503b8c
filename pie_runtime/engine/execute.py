"""Execute, the middle of the engine step: one batched forward over the scheduled chunks of one model, then
the readouts and epilogue programs of the fires it finished. Nothing here changes a working set: the
outcomes go to commit (step.py)."""

from __future__ import annotations

import time

import torch

from ..models.context import Segment
from ..protocol import ErrorCode, PieError
from .channels import Txn
from .jobs import FireJob, FireOutcome, StepStats
from .programs import run_program
from .programs.fire import FireIntrinsics
from .runner import ReadoutRequest
from .scheduler import Chunk
from .served import ServedModel


def execute(sm: ServedModel, chunks: list[Chunk[FireJob]], stats: StepStats) -> list[FireOutcome]:
    """Runs the chunks; returns the outcome of every fire whose last rows ran."""
    t0 = time.perf_counter()
    finished = _forward(sm, chunks)
    requests = [
        ReadoutRequest(
            r,
            torch.stack([j.hidden[row] for row in r.rows]),
            mask,
            [j.tokens[row + 1] if row + 1 < len(j.tokens) else -1 for row in r.rows] if r.at_accepted else None,
        )
        for j in finished
        for r, mask in zip(j.readouts, j.masks)
        if r.rows
    ]
    results, raw = sm.runner.readouts(requests) if requests else ([], [])
    t1 = time.perf_counter()
    stats.forward_s += t1 - t0
    stats.rows += sum(c.rows for c in chunks)
    it = iter(zip(results, raw))
    outcomes = []
    for j in finished:
        answered, logits = [], {}
        for r in j.readouts:
            res, lg = next(it) if r.rows else ({}, None)
            answered.append(res)
            if lg is not None:
                logits[tuple(r.rows)] = lg
        outcome = _epilogue(sm, j, logits)
        outcome.results = answered
        outcomes.append(outcome)
    stats.epilogue_s += time.perf_counter() - t1
    return outcomes


def _forward(sm: ServedModel, chunks: list[Chunk[FireJob]]) -> list[FireJob]:
    """One forward over every chunk; keeps the hidden states of the rows a readout or program reads and
    returns the fires that ran their last rows."""
    segments, tokens, positions = [], [], []
    for c in chunks:
        j = c.job
        segments.append(Segment(j.ws.pages, j.start + j.done, c.rows))
        tokens.extend(j.tokens[j.done : j.done + c.rows])
        positions.extend(j.positions[j.done : j.done + c.rows])
    hidden = sm.runner.forward(segments, tokens, positions)
    offset = 0
    finished: list[FireJob] = []
    for c in chunks:
        j = c.job
        wanted = {row for r in j.readouts for row in r.rows} | (j.program.rows if j.program else set())
        for row in range(j.done, j.done + c.rows):
            if row in wanted:
                j.hidden[row] = hidden[offset + row - j.done]
        offset += c.rows
        j.done += c.rows
        if j.remaining == 0:
            finished.append(j)
    return finished


def _epilogue(sm: ServedModel, j: FireJob, logits: dict[tuple[int, ...], torch.Tensor]) -> FireOutcome:
    """Runs the fire's program; ``logits`` (readout rows → raw logits) spares it a second lm head."""
    if j.program is None:
        return FireOutcome(j)
    txn = Txn(j.bindings)
    try:
        intrinsics = FireIntrinsics(sm.runner, j.hidden, j.tokens, logits)
        fold = run_program(j.program, intrinsics, txn, sm.runner.device)
        if fold is not None and not 0 <= fold <= len(j.tokens):
            raise PieError(ErrorCode.PROGRAM_FAILED, f"the epilogue folds {fold}, outside [0, {len(j.tokens)}]")
        txn.commit()
    except PieError as e:
        return FireOutcome(j, error=e)
    return FireOutcome(j, device_fold=fold, txn=txn)
