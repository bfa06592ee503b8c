"""The engine core: applies protocol requests to working sets, channels and programs; the step that runs
the queued fires (schedule → execute → commit) is mixed in from step.py, the program and channel
requests from programs/requests.py.

Every request is checked before it changes anything, so a refused request leaves no trace; a fire's pages
are reserved when it is accepted, so running out of pages is an immediate typed error, never a stall.
A fire may carry an epilogue program (run right after the forward; its channel writes and fold are one
transaction) and may be left with the engine as a run-ahead, re-fired after every step until it stops.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np

from ..protocol import ErrorCode, PieError
from ..protocol import messages as m
from .channels import ChannelTable
from .jobs import FireJob, Reply, ServedModel, StepStats
from .programs import Program
from .programs.requests import ProgramRequests
from .spec_totals import SpecTotals
from .step import StepLoop
from .working_set import WorkingSet

__all__ = ["EngineCore", "FireJob", "Reply", "ServedModel", "StepStats"]


class EngineCore(ProgramRequests, StepLoop):
    def __init__(self, models: list[ServedModel], max_batch_tokens: int = 256):
        self.models = {sm.name: sm for sm in models}
        self.default_model = models[0].name
        self.max_batch_tokens = max_batch_tokens
        self.working_sets: dict[int, WorkingSet] = {}
        self.spec_totals: dict[str, dict[str, SpecTotals]] = {}  # model → inferlet → summed run counters
        self._ids = itertools.count(1)
        self.stats = StepStats()
        self.channels = ChannelTable()
        self.programs: dict[bytes, dict[str, Program]] = {}  # client → hash → program
        self.outbox: list[Reply] = []  # replies owed outside the request being handled (waiting takes)
        for sm in models:
            if not sm.info.hidden_size:
                sm.info.hidden_size = sm.runner.model.config.hidden_size

    # ---- requests -------------------------------------------------------------------------------

    def handle(self, client: bytes, req) -> dict | None:
        """Applies one request. Returns the reply, or None when the reply comes after a step (fires)."""
        handler = getattr(self, f"_op_{req.op}")
        return handler(client, req)

    def _op_ping(self, client, req: m.Ping) -> dict:
        return {}

    def _op_hello(self, client, req: m.Hello) -> dict:
        if req.version != m.PROTOCOL_VERSION:
            raise PieError(
                ErrorCode.VERSION_MISMATCH, f"client speaks protocol {req.version}, engine {m.PROTOCOL_VERSION}"
            )
        return {
            "version": m.PROTOCOL_VERSION,
            "default_model": self.default_model,
            "models": [sm.info.model_dump() for sm in self.models.values()],
        }

    def _op_tokenizer(self, client, req: m.GetTokenizer) -> dict:
        return {"tokenizer_json": self._model(req.model).tokenizer_json}

    def _op_stats(self, client, req: m.Stats) -> dict:
        s = self.stats
        return {
            "steps": s.steps,
            "rows": s.rows,
            "fires": s.fires,
            "forward_s": s.forward_s,
            "epilogue_s": s.epilogue_s,
            "step_s": s.step_s,
            "working_sets": len(self.working_sets),
            "channels": len(self.channels.channels),
            "programs": sum(len(p) for p in self.programs.values()),
            "run_ahead": sum(j.run is not None for sm in self.models.values() for j in sm.queue),
            "models": {
                name: {"pages_total": sm.pool.num_pages, "pages_free": sm.pool.free_pages, "queued": len(sm.queue)}
                for name, sm in self.models.items()
            },
            "speculation": {
                name: {inferlet: t.as_dict() for inferlet, t in by_inferlet.items()}
                for name, by_inferlet in self.spec_totals.items()
            },
        }

    def _op_spec_report(self, client, req: m.SpecReport) -> dict:
        sm = self._model(req.model)
        by_inferlet = self.spec_totals.setdefault(sm.name, {})
        by_inferlet.setdefault(req.inferlet, SpecTotals()).add(req)
        return {}

    def _op_ws_open(self, client, req: m.WsOpen) -> dict:
        sm = self._model(req.model)
        ws = WorkingSet(id=next(self._ids), owner=client, model=sm.name)
        self.working_sets[ws.id] = ws
        return {"ws": ws.id, "model": sm.name, "committed": 0}

    def _op_ws_fork(self, client, req: m.WsFork) -> dict:
        parent = self._idle_ws(client, req.ws)
        sm = self.models[parent.model]
        keep = parent.pages[: parent.pages_for(parent.committed, sm.info.page_size)]
        sm.pool.share(keep)  # copy-on-write: the first fire that writes a shared page copies it
        child = WorkingSet(id=next(self._ids), owner=client, model=parent.model, pages=list(keep),
                           committed=parent.committed)
        self.working_sets[child.id] = child
        return {"ws": child.id, "committed": child.committed}

    def _op_ws_release(self, client, req: m.WsRelease) -> dict:
        ws = self._ws(client, req.ws)
        self._release(ws)
        return {}

    def _check_settle(self, ws: WorkingSet, n: int) -> None:
        if ws.in_flight:
            raise PieError(ErrorCode.BUSY, "fold after the deferred fire has been answered")
        if ws.pending_fold is None:
            raise PieError(ErrorCode.NO_PENDING_FOLD, f"working set {ws.id} has no deferred fold to settle")
        if n > ws.pending_fold:
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"fold {n} exceeds the fire's {ws.pending_fold} rows")

    def _op_ws_fold(self, client, req: m.WsFold) -> dict:
        ws = self._ws(client, req.ws)
        self._check_settle(ws, req.n)
        ws.committed += req.n
        ws.pending_fold = None
        self._trim(ws)
        return {"committed": ws.committed}

    def _op_ws_truncate(self, client, req: m.WsTruncate) -> dict:
        ws = self._idle_ws(client, req.ws)
        if req.n > ws.committed:
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"truncate to {req.n} past committed length {ws.committed}")
        ws.committed = req.n
        self._trim(ws)
        return {"committed": ws.committed}

    def _op_fire(self, client, req: m.Fire) -> None:
        ws = self._ws(client, req.ws)
        if req.settle is not None:
            self._check_settle(ws, req.settle)
        elif ws.pending_fold is not None:
            raise PieError(ErrorCode.FOLD_PENDING, f"working set {ws.id} has a deferred fold to settle first")
        sm = self.models[ws.model]
        info = sm.info
        source = self._source(client, req, ws)
        w = len(req.tokens) if source is None else source.shape[0]
        start = ws.committed + req.settle if req.settle is not None else self._planned_length(ws)
        bad = next((t for t in req.tokens or [] if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise PieError(ErrorCode.TOKEN_OUT_OF_RANGE, f"token id {bad} outside vocab [0, {info.vocab_size})")
        if start + w > info.max_positions:
            raise PieError(
                ErrorCode.CAPACITY, f"rows {start}..{start + w - 1} exceed the model's {info.max_positions} positions"
            )
        positions = list(range(start, start + w)) if req.positions is None else req.positions
        if len(positions) != w or any(not 0 <= p < info.max_positions for p in positions):
            raise PieError(ErrorCode.INVALID_ARGUMENT, "positions need one value per token, each within capacity")
        masks = [self._check_readout(r, w, sm) for r in req.readouts]
        program, bindings = self._bind(client, req, ws, w)
        if req.fold == m.DEFERRED:
            fold = None
        else:
            if program is not None and program.folds:
                raise PieError(ErrorCode.INVALID_ARGUMENT, "a fire whose program folds needs fold=deferred")
            fold = w if req.fold is None else req.fold
            if not 0 <= fold <= w:
                raise PieError(ErrorCode.INVALID_ARGUMENT, f"fold {fold} outside [0, {w}]")
        run = self._check_run_ahead(client, req, program, bindings, source)
        pending = ws.pending_fold
        if req.settle is not None:
            ws.committed, ws.pending_fold = start, None
        try:
            self._reserve_pages(ws, sm, start, w)
        except PieError:
            if req.settle is not None:  # a refused fire leaves no trace, its settle included
                ws.committed, ws.pending_fold = start - req.settle, pending
            raise
        job = FireJob(client, req.id, ws, list(req.tokens or []), positions, list(req.readouts), masks, fold, start,
                      program=program, bindings=bindings, source=source, run=run)
        self._enqueue(sm, job)
        return None

    def _enqueue(self, sm: ServedModel, job: FireJob) -> None:
        job.ws.in_flight += 1
        if job.fold is None:
            job.ws.pending_fold = len(job.positions)  # refuses the next fire from now on
        sm.queue.append(job)

    # ---- checks and page bookkeeping --------------------------------------------------------------

    def _model(self, name: str | None) -> ServedModel:
        sm = self.models.get(name or self.default_model)
        if sm is None:
            raise PieError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r}; serving {', '.join(self.models)}")
        return sm

    def _ws(self, client: bytes, ws_id: int) -> WorkingSet:
        ws = self.working_sets.get(ws_id)
        if ws is None or ws.owner != client:
            raise PieError(ErrorCode.UNKNOWN_WORKING_SET, f"no working set {ws_id} (never opened, or released)")
        return ws

    def _idle_ws(self, client: bytes, ws_id: int) -> WorkingSet:
        ws = self._ws(client, ws_id)
        if ws.in_flight:
            raise PieError(ErrorCode.BUSY, f"working set {ws.id} has fires in flight")
        if ws.pending_fold is not None:
            raise PieError(ErrorCode.FOLD_PENDING, f"working set {ws.id} has a deferred fold to settle first")
        return ws

    def _planned_length(self, ws: WorkingSet) -> int:
        """Committed length once every queued fire of ``ws`` has folded (queued fires never defer)."""
        sm = self.models[ws.model]
        return ws.committed + sum(j.fold or 0 for j in sm.queue if j.ws is ws)

    def _check_readout(self, r: m.Readout, w: int, sm: ServedModel) -> np.ndarray | None:
        if any(not 0 <= row < w for row in r.rows):
            raise PieError(ErrorCode.ROW_OUT_OF_RANGE, f"readout rows must lie in the fire's window [0, {w})")
        if r.kind == "mtp" and sm.runner.mtp is None:
            raise PieError(ErrorCode.UNSUPPORTED, f"model {sm.name} has no MTP drafter")
        if r.kind == "mtp" and r.k > sm.info.mtp_depth:
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"MTP({r.k}) past the drafter's depth {sm.info.mtp_depth}")
        if r.at_accepted and (r.kind != "mtp" or r.with_probs):
            raise PieError(ErrorCode.INVALID_ARGUMENT, "at_accepted is for greedy MTP readouts (no with_probs)")
        if r.at_accepted and r.rows and r.rows != list(range(r.rows[0], r.rows[0] + len(r.rows))):
            raise PieError(ErrorCode.INVALID_ARGUMENT, "an at_accepted MTP readout reads consecutive rows")
        if r.mask is None:
            return None
        words = (sm.info.vocab_size + 31) // 32
        mask = r.mask.to_numpy()
        if mask.dtype not in (np.int32, np.uint32) or mask.shape != (len(r.rows), words):
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"mask must be int32 of shape ({len(r.rows)}, {words})")
        return mask

    def _reserve_pages(self, ws: WorkingSet, sm: ServedModel, start: int, w: int) -> None:
        ps, pool = sm.info.page_size, sm.pool
        need = ws.pages_for(start + w, ps)
        grow = max(0, need - len(ws.pages))
        shared = [i for i in range(start // ps, min(need, len(ws.pages))) if pool.refcount(ws.pages[i]) > 1]
        fresh = pool.alloc(grow + len(shared))  # all or nothing
        if shared:
            src = [ws.pages[i] for i in shared]
            dst = fresh[grow:]
            sm.runner.copy_pages(src, dst)
            pool.release(src)
            for i, p in zip(shared, dst):
                ws.pages[i] = p
        ws.pages.extend(fresh[:grow])

    def _trim(self, ws: WorkingSet) -> None:
        """Returns pages past the committed length (they hold only unfolded rows)."""
        sm = self.models[ws.model]
        keep = ws.pages_for(ws.committed, sm.info.page_size)
        sm.pool.release(ws.pages[keep:])
        del ws.pages[keep:]

    def _release(self, ws: WorkingSet, notify: bool = True) -> None:
        sm = self.models[ws.model]
        ws.released = True
        self.working_sets.pop(ws.id, None)
        if ws.in_flight:
            # its queued fires are dropped (a run-ahead stops); their pages go back with the rest
            dropped = [j for j in sm.queue if j.ws is ws]
            sm.queue = deque(j for j in sm.queue if j.ws is not ws)
            ws.in_flight = 0
            if notify:
                err = PieError(ErrorCode.UNKNOWN_WORKING_SET, f"working set {ws.id} was released in flight")
                self.outbox.extend((j.client, {"id": j.req_id, "ok": False, "error": err.to_wire()})
                                   for j in dropped)
        sm.pool.release(ws.pages)
        ws.pages = []

    def drop_client(self, client: bytes) -> int:
        """Releases everything a departed client held (its run-aheads stop with their working sets).
        Returns how many working sets it had."""
        mine = [ws for ws in self.working_sets.values() if ws.owner == client]
        for ws in mine:
            self._release(ws, notify=False)
        self.channels.drop_client(client)
        self.programs.pop(client, None)
        self.outbox = [r for r in self.outbox if r[0] != client]
        return len(mine)

    def drain_outbox(self) -> list[Reply]:
        out, self.outbox = self.outbox, []
        return out
