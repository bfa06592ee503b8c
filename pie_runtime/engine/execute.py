"""Execute, the middle of the engine step: one batched forward over the scheduled chunks of one model, then
the readouts and epilogue programs of the fires it finished. Nothing here changes a working set: the
outcomes go to commit (step.py)."""

from __future__ import annotations

import logging
import time

import torch

from ..models.context import Segment
from ..protocol import ErrorCode, PieError
from ..protocol.tree import fold_path
from .channels import Txn
from .jobs import FireJob, FireOutcome, StepStats
from .programs import run_program
from .programs.fire import FireIntrinsics
from .runner import ReadoutRequest
from .scheduler import Chunk
from .served import ServedModel
from .state_slots import DIRTY

log = logging.getLogger("pie.engine")


def execute(sm: ServedModel, chunks: list[Chunk[FireJob]], stats: StepStats) -> list[FireOutcome]:
    """Runs the chunks; returns the outcome of every fire whose last rows ran, and of every fire that failed.

    Faults are contained per fire: when the batched forward or the batched readouts raise, they are run again
    one fire at a time, so that only the guilty fire fails (``error`` set; commit answers it and releases what
    it reserved) and the others go on; an epilogue that raises fails its own fire only. An exception that is
    not a :class:`PieError` becomes one (``internal``, or ``program_failed`` in an epilogue) that names its
    type, and is logged once."""
    t0 = time.perf_counter()
    finished, failed = _forward(sm, chunks, stats)
    finished, failed_readouts = _readouts(sm, finished)
    failed += failed_readouts
    t1 = time.perf_counter()
    stats.forward_s += t1 - t0
    outcomes = failed
    for j, answered, logits in finished:
        try:
            outcome = _epilogue(sm, j, logits)
        except Exception as e:  # noqa: BLE001 - contained: costs this fire only
            outcome = FireOutcome(j, error=contained(e, "epilogue", ErrorCode.PROGRAM_FAILED))
        outcome.results = answered
        outcomes.append(outcome)
    stats.epilogue_s += time.perf_counter() - t1
    return outcomes


def contained(e: Exception, where: str, code: ErrorCode = ErrorCode.INTERNAL) -> PieError:
    """The typed error a fire fails with when ``where`` raised ``e``; anything but a PieError is logged."""
    if isinstance(e, PieError):
        return e.with_traceback(None)
    log.exception("a fire's %s raised; failing that fire only", where)
    return PieError(code, f"the fire's {where} failed: {type(e).__name__}: {e}"[:1000])


def _forward(
    sm: ServedModel, chunks: list[Chunk[FireJob]], stats: StepStats
) -> tuple[list[FireJob], list[FireOutcome]]:
    """One forward over every chunk; keeps the hidden states of the rows a readout or program reads. Returns
    the fires that ran their last rows, and the failures. A batch that raises is run again chunk by chunk
    (rewriting the same unfrozen KV rows); a fire's ``done`` and ``hidden`` move only after its rows ran."""
    try:
        hidden = _run_forward(sm, chunks)
    except Exception as e:  # noqa: BLE001 - contained below
        if len(chunks) == 1:
            return [], [FireOutcome(chunks[0].job, error=contained(e, "forward"))]
        finished: list[FireJob] = []
        failed: list[FireOutcome] = []
        for c in chunks:
            f, x = _forward(sm, [c], stats)
            finished += f
            failed += x
        return finished, failed
    stats.rows += sum(c.rows for c in chunks)
    return _advance(chunks, hidden), []


def _run_forward(sm: ServedModel, chunks: list[Chunk[FireJob]]) -> torch.Tensor:
    """One forward; with an EAGLE head, each working set's feature tail goes in and its new one is kept. With
    recurrent state, a fire's rows run again after a forward that raised (``_state_lead``); only each chunk's own
    rows are returned."""
    segments, tokens, positions, keep = [], [], [], []
    for c in chunks:
        j = c.job
        lead = _state_lead(sm, j)
        first = j.done - lead
        parents = None if j.parents is None else tuple(j.parents)
        rows = lead + c.rows
        kept = _row_states(sm, j, first, rows)
        segments.append(Segment(j.ws.pages, j.start + first, rows, parents, j.start, state=_slot(j), row_states=kept))
        tokens.extend(j.tokens[first : j.done + c.rows])
        positions.extend(j.positions[first : j.done + c.rows])
        keep.extend(range(len(tokens) - c.rows, len(tokens)))
    if sm.runner.eagle is None:
        hidden = sm.runner.forward(segments, tokens, positions)
    else:  # an EAGLE head is refused on a model with recurrent state (drafters.py), so no lead rows here
        hidden = sm.runner.forward(segments, tokens, positions, [c.job.ws.drafter_tail for c in chunks])
        for c, tail in zip(chunks, sm.runner.tails(segments, hidden)):
            c.job.ws.drafter_tail = tail
    for c in chunks:
        if (hold := c.job.ws.state) is not None:
            hold.ran = c.job.done + c.rows
    return hidden if len(keep) == hidden.shape[0] else hidden[keep]


def _slot(j: FireJob) -> int | None:
    return j.ws.state.slot if j.ws.state is not None else None


def _row_states(sm: ServedModel, j: FireJob, first: int, rows: int) -> tuple[int, ...]:
    """The state-pool entries receiving the state after the chunk's rows ``first ..`` that the fire keeps
    per-row states for (``SlotHold.keep``; a prefix of the chunk's rows, or none)."""
    hold = j.ws.state
    if hold is None or first >= hold.keep:
        return ()
    return sm.runner.row_state_entries(hold.slot, first, min(rows, hold.keep - first))


def _partial(j: FireJob) -> bool:
    """Whether ``j``'s fold may keep fewer rows than it runs: deferred, or a fixed count (path) below them."""
    return j.fold is None or (j.fold if isinstance(j.fold, int) else len(j.fold)) < len(j.tokens)


def _state_lead(sm: ServedModel, j: FireJob) -> int:
    """Rows of ``j`` already run that this forward runs again (0 but after a forward that raised): with
    recurrent state, a fire's first rows save the state (the snapshot), and a forward that raised leaves the
    state unknown, so the retry restores the snapshot and runs the fire's earlier rows again before its chunk."""
    hold, states = j.ws.state, sm.states
    if hold is None or states is None:
        return 0
    lead = 0
    if hold.fire is not j:
        states.begin(hold, j, j.start, j.tokens, j.positions, _partial(j))
    elif hold.ran != j.done:
        sm.runner.restore_state(hold.slot)
        lead = j.done
    hold.ran = DIRTY
    return lead


def _advance(chunks: list[Chunk[FireJob]], hidden: torch.Tensor) -> list[FireJob]:
    """After a successful forward: keeps the wanted hidden rows, moves ``done``; returns the finished fires."""
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


Logits = dict[tuple[int, ...], torch.Tensor]  # readout rows → raw logits, reused by the epilogue


def _readouts(
    sm: ServedModel, jobs: list[FireJob]
) -> tuple[list[tuple[FireJob, list[dict], Logits]], list[FireOutcome]]:
    """The readouts of the finished fires, batched in one lm head; when the batch raises, fire by fire.
    Returns (fire, its results, its logits) per fire that read out, and the failures."""
    try:
        return _read(sm, jobs), []
    except Exception as e:  # noqa: BLE001 - contained below
        if len(jobs) == 1:
            return [], [FireOutcome(jobs[0], error=contained(e, "readouts"))]
    done: list[tuple[FireJob, list[dict], Logits]] = []
    failed: list[FireOutcome] = []
    for j in jobs:
        d, f = _readouts(sm, [j])
        done += d
        failed += f
    return done, failed


def _read(sm: ServedModel, jobs: list[FireJob]) -> list[tuple[FireJob, list[dict], Logits]]:
    requests = [
        ReadoutRequest(
            r,
            torch.stack([j.hidden[row] for row in r.rows]),
            mask,
            [j.tokens[row + 1] if row + 1 < len(j.tokens) else -1 for row in r.rows] if r.at_accepted else None,
            j.ws.pages if r.kind == "eagle" else None,
            j.start,
        )
        for j in jobs
        for r, mask in zip(j.readouts, j.masks)
        if r.rows
    ]
    results, raw = sm.runner.readouts(requests) if requests else ([], [])
    it = iter(zip(results, raw))
    out = []
    for j in jobs:
        answered, logits = [], {}
        for r in j.readouts:
            res, lg = next(it) if r.rows else ({}, None)
            answered.append(res)
            if lg is not None:
                logits[tuple(r.rows)] = lg
        out.append((j, answered, logits))
    return out


def _epilogue(sm: ServedModel, j: FireJob, logits: dict[tuple[int, ...], torch.Tensor]) -> FireOutcome:
    """Runs the fire's program; ``logits`` (readout rows → raw logits) spares it a second lm head."""
    if j.program is None:
        return FireOutcome(j)
    txn = Txn(j.bindings)
    try:
        intrinsics = FireIntrinsics(sm.runner, j.hidden, j.tokens, logits)
        fold = run_program(j.program, intrinsics, txn, sm.runner.device)
        path = None if fold is None else _device_path(fold, j)
        txn.commit()
    except PieError as e:
        return FireOutcome(j, error=e.with_traceback(None))  # its frames would keep the fire's tensors alive
    return FireOutcome(j, device_fold=path, txn=txn)


def _device_path(fold: int | list[int], j: FireJob) -> list[int]:
    """The window rows an epilogue's fold commits (a count, or a path of a tree window), checked."""
    try:
        return fold_path(fold, j.parents, len(j.tokens))
    except PieError as e:
        raise PieError(ErrorCode.PROGRAM_FAILED, f"the epilogue folds {fold}: {e.message}") from None
