"""Execute, the middle of the engine step: one batched forward over the scheduled chunks of one model, then
the readouts and epilogue programs of the fires it finished. Nothing here changes a working set: the
outcomes go to commit (step.py)."""

from __future__ import annotations

import logging
import time

import torch

from ..models.attention_scores import ScoreRow
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


def execute(served: ServedModel, chunks: list[Chunk[FireJob]], stats: StepStats) -> list[FireOutcome]:
    """Runs the chunks; returns the outcome of every fire whose last rows ran, and of every fire that failed.

    Faults are contained per fire: when the batched forward or the batched readouts raise, they are run again
    one fire at a time, so that only the guilty fire fails (``error`` set; commit answers it and releases what
    it reserved) and the others go on; an epilogue that raises fails its own fire only. An exception that is
    not a :class:`PieError` becomes one (``internal``, or ``program_failed`` in an epilogue) that names its
    type, and is logged once."""
    t0 = time.perf_counter()
    finished, failed = _forward(served, chunks, stats)
    finished, failed_readouts = _readouts(served, finished)
    failed += failed_readouts
    t1 = time.perf_counter()
    stats.forward_s += t1 - t0
    outcomes = failed
    for fire, answered, logits in finished:
        try:
            outcome = _epilogue(served, fire, logits)
        except Exception as e:  # noqa: BLE001 - contained: costs this fire only
            outcome = FireOutcome(fire, error=contained(e, "epilogue", ErrorCode.PROGRAM_FAILED))
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
    served: ServedModel, chunks: list[Chunk[FireJob]], stats: StepStats
) -> tuple[list[FireJob], list[FireOutcome]]:
    """One forward over every chunk; keeps the hidden states of the rows a readout or program reads. Returns
    the fires that ran their last rows, and the failures. A batch that raises is run again chunk by chunk
    (rewriting the same unfrozen KV rows); a fire's ``done`` and ``hidden`` move only after its rows ran."""
    try:
        hidden = _run_forward(served, chunks)
    except Exception as e:  # noqa: BLE001 - contained below
        if len(chunks) == 1:
            return [], [FireOutcome(chunks[0].job, error=contained(e, "forward"))]
        finished: list[FireJob] = []
        failed: list[FireOutcome] = []
        for c in chunks:
            f, x = _forward(served, [c], stats)
            finished += f
            failed += x
        return finished, failed
    stats.rows += sum(c.rows for c in chunks)
    return _advance(chunks, hidden), []


def _run_forward(served: ServedModel, chunks: list[Chunk[FireJob]]) -> torch.Tensor:
    """One forward; with an EAGLE head, each working set's feature tail goes in and its new one is kept. With
    recurrent state, a fire's rows run again after a forward that raised (``_state_lead``); only each chunk's own
    rows are returned."""
    segments, tokens, positions, keep = [], [], [], []
    wanted: list[tuple[FireJob, int, int]] = []  # attention readouts' (fire, readout, row), in score_rows' order
    score_rows: list[ScoreRow] = []
    for c in chunks:
        fire = c.job
        lead = _state_lead(served, fire)
        first = fire.done - lead
        parents = None if fire.parents is None else tuple(fire.parents)
        rows = lead + c.rows
        kept = _row_states(served, fire, first, rows)
        served.pages.advance(fire.ws, fire.start, fire.start + first, fire.start + fire.done + c.rows)
        segments.append(
            Segment(
                fire.ws.pages,
                fire.start + first,
                rows,
                parents,
                fire.start,
                state=_slot(fire),
                row_states=kept,
                group_tables=tuple(fire.ws.tables[1:]),
            )
        )
        for i, row in _score_rows(fire, fire.done, fire.done + c.rows):
            wanted.append((fire, i, row))
            score_rows.append(
                ScoreRow(len(tokens) + row - first, fire.start + len(fire.tokens), fire.readouts[i].per_layer)
            )
        tokens.extend(fire.tokens[first : fire.done + c.rows])
        positions.extend(fire.positions[first : fire.done + c.rows])
        keep.extend(range(len(tokens) - c.rows, len(tokens)))
    scores = served.runner.pass_scores(segments, score_rows) if score_rows else None
    if served.runner.eagle is None:
        hidden = served.runner.forward(segments, tokens, positions, scores=scores)
    else:  # an EAGLE head is refused on a model with recurrent state (drafters.py), so no lead rows here
        tails = [c.job.ws.drafter_tail for c in chunks]
        hidden = served.runner.forward(segments, tokens, positions, tails, scores=scores)
        for c, tail in zip(chunks, served.runner.tails(segments, hidden)):
            c.job.ws.drafter_tail = tail
    if scores is not None:
        for (fire, i, row), mass in zip(wanted, scores.results()):
            fire.scores[(i, row)] = mass
    for c in chunks:
        if (hold := c.job.ws.state) is not None:
            hold.ran = c.job.done + c.rows
    return hidden if len(keep) == hidden.shape[0] else hidden[keep]


def _score_rows(fire: FireJob, lo: int, hi: int) -> list[tuple[int, int]]:
    """(readout index, window row) of the fire's attention readouts at its rows ``lo .. hi-1``."""
    return [(i, row) for i, r in enumerate(fire.readouts) if r.kind == "attention" for row in r.rows if lo <= row < hi]


def _slot(fire: FireJob) -> int | None:
    return fire.ws.state.slot if fire.ws.state is not None else None


def _row_states(served: ServedModel, fire: FireJob, first: int, rows: int) -> tuple[int, ...]:
    """The state-pool entries receiving the state after the chunk's rows ``first ..`` that the fire keeps
    per-row states for (``SlotHold.keep``; a prefix of the chunk's rows, or none)."""
    hold = fire.ws.state
    if hold is None or first >= hold.keep:
        return ()
    return served.runner.row_state_entries(hold.slot, first, min(rows, hold.keep - first))


def _partial(fire: FireJob) -> bool:
    """Whether ``fire``'s fold may keep fewer rows than it runs: deferred, or a fixed count (path) below them."""
    return fire.fold is None or (fire.fold if isinstance(fire.fold, int) else len(fire.fold)) < len(fire.tokens)


def _state_lead(served: ServedModel, fire: FireJob) -> int:
    """Rows of ``fire`` already run that this forward runs again (0 but after a forward that raised): with
    recurrent state, a fire's first rows save the state (the snapshot), and a forward that raised leaves the
    state unknown, so the retry restores the snapshot and runs the fire's earlier rows again before its chunk."""
    hold, states = fire.ws.state, served.states
    if hold is None or states is None:
        return 0
    lead = 0
    if hold.fire is not fire:
        states.begin(hold, fire, fire.start, fire.tokens, fire.positions, _partial(fire))
    elif hold.ran != fire.done:
        served.runner.restore_state(hold.slot)
        lead = fire.done
    hold.ran = DIRTY
    return lead


def _advance(chunks: list[Chunk[FireJob]], hidden: torch.Tensor) -> list[FireJob]:
    """After a successful forward: keeps the wanted hidden rows, moves ``done``; returns the finished fires."""
    offset = 0
    finished: list[FireJob] = []
    for c in chunks:
        fire = c.job
        wanted = {row for r in fire.readouts for row in r.rows} | (fire.program.rows if fire.program else set())
        for row in range(fire.done, fire.done + c.rows):
            if row in wanted:
                fire.hidden[row] = hidden[offset + row - fire.done]
        offset += c.rows
        fire.done += c.rows
        if fire.remaining == 0:
            finished.append(fire)
    return finished


Logits = dict[tuple[int, ...], torch.Tensor]  # readout rows → raw logits, reused by the epilogue


def _readouts(
    served: ServedModel, fires: list[FireJob]
) -> tuple[list[tuple[FireJob, list[dict], Logits]], list[FireOutcome]]:
    """The readouts of the finished fires, batched in one lm head; when the batch raises, fire by fire.
    Returns (fire, its results, its logits) per fire that read out, and the failures."""
    try:
        return _read(served, fires), []
    except Exception as e:  # noqa: BLE001 - contained below
        if len(fires) == 1:
            return [], [FireOutcome(fires[0], error=contained(e, "readouts"))]
    done: list[tuple[FireJob, list[dict], Logits]] = []
    failed: list[FireOutcome] = []
    for fire in fires:
        d, f = _readouts(served, [fire])
        done += d
        failed += f
    return done, failed


def _read(served: ServedModel, fires: list[FireJob]) -> list[tuple[FireJob, list[dict], Logits]]:
    requests = [
        ReadoutRequest(
            r,
            torch.stack([fire.hidden[row] for row in r.rows]),
            mask,
            [fire.tokens[row + 1] if row + 1 < len(fire.tokens) else -1 for row in r.rows] if r.at_accepted else None,
            fire.ws.pages if r.kind == "eagle" else None,
            fire.start,
            [fire.scores[(i, row)] for row in r.rows] if r.kind == "attention" else None,
        )
        for fire in fires
        for i, (r, mask) in enumerate(zip(fire.readouts, fire.masks))
        if r.rows
    ]
    results, raw = served.runner.readouts(requests) if requests else ([], [])
    it = iter(zip(results, raw))
    out = []
    for fire in fires:
        answered, logits = [], {}
        for r in fire.readouts:
            res, lg = next(it) if r.rows else ({}, None)
            answered.append(res)
            if lg is not None:
                logits[tuple(r.rows)] = lg
        out.append((fire, answered, logits))
    return out


def _epilogue(served: ServedModel, fire: FireJob, logits: dict[tuple[int, ...], torch.Tensor]) -> FireOutcome:
    """Runs the fire's program; ``logits`` (readout rows → raw logits) spares it a second lm head."""
    if fire.program is None:
        return FireOutcome(fire)
    txn = Txn(fire.bindings)
    try:
        intrinsics = FireIntrinsics(served.runner, fire.hidden, fire.tokens, logits)
        fold = run_program(fire.program, intrinsics, txn, served.runner.device)
        path = None if fold is None else _device_path(fold, fire)
        txn.commit()
    except PieError as e:
        return FireOutcome(fire, error=e.with_traceback(None))  # its frames would keep the fire's tensors alive
    return FireOutcome(fire, device_fold=path, txn=txn)


def _device_path(fold: int | list[int], fire: FireJob) -> list[int]:
    """The window rows an epilogue's fold commits (a count, or a path of a tree window), checked."""
    try:
        return fold_path(fold, fire.parents, len(fire.tokens))
    except PieError as e:
        raise PieError(ErrorCode.PROGRAM_FAILED, f"the epilogue folds {fold}: {e.message}") from None
