"""The engine step, mixed into EngineCore: schedule → execute → commit over the queued fires of every
client, once per model. Execute runs one forward over the scheduled chunks, then the readouts and
epilogues of the fires it finished; commit applies their folds, answers them, and re-queues run-aheads.

Needs from its host: ``models``, ``channels``, ``stats``, ``max_batch_tokens``, ``_enqueue``,
``_reserve_pages``, ``_trim``, ``_has_writer`` and ``drain_outbox``.
"""

from __future__ import annotations

import time

import torch

from ..models.context import Segment
from ..protocol import ErrorCode, PieError
from ..protocol.arrays import encode_array
from .channels import Txn, poison
from .jobs import FireJob, Reply, ServedModel
from .programs import run_program
from .programs.fire import FireIntrinsics
from .runner import ReadoutRequest
from .scheduler import Chunk, schedule


class StepLoop:

    def has_work(self) -> bool:
        return any(self._runnable(sm) for sm in self.models.values())

    def step(self) -> list[Reply]:
        """schedule → execute → commit, once per model with runnable fires."""
        t0 = time.perf_counter()
        replies: list[Reply] = []
        for sm in self.models.values():
            replies.extend(self._resolve(sm))
            runnable = self._runnable(sm)
            if not runnable:
                continue
            chunks = schedule(runnable, self.max_batch_tokens)
            finished = self._execute(sm, chunks)
            replies.extend(self._commit(sm, finished))
        replies.extend(self.channels.serve(self._has_writer))
        replies.extend(self.drain_outbox())
        self.stats.steps += 1
        self.stats.step_s += time.perf_counter() - t0
        return replies

    def _heads(self, sm: ServedModel) -> list[FireJob]:
        seen, heads = set(), []
        for j in sm.queue:
            if id(j.ws) not in seen:
                seen.add(id(j.ws))
                heads.append(j)
        return heads

    def _runnable(self, sm: ServedModel) -> list[FireJob]:
        """The queue less the working sets whose oldest fire waits on a channel (no input, no room)."""
        blocked = {id(j.ws) for j in self._heads(sm) if not self._ready(j)}
        return [j for j in sm.queue if id(j.ws) not in blocked]

    def _ready(self, j: FireJob) -> bool:
        if j.done:
            return True
        if j.source is not None and not j.tokens and not j.source.cells and j.source.poison is None:
            return False
        if j.program is not None:
            for slot, n in j.program.puts.items():
                ch = j.bindings[slot]
                room = ch.free + j.program.takes.get(slot, 0) + (ch is j.source and not j.tokens)
                if room < n <= ch.capacity and ch.poison is None:
                    return False  # waits for the host to take; a put that can never fit fails instead
        return True

    def _resolve(self, sm: ServedModel) -> list[Reply]:
        """Before a step: stops flagged run-aheads, and takes the input window of channel-fed fires."""
        replies = []
        for j in self._heads(sm):
            if j.done or not self._ready(j):
                continue
            if j.run is not None and self._flagged(j):
                j.run.reason = "stop_channel"
                replies.append(self._finish(sm, j, self._run_reply(j)))
            elif j.source is not None and not j.tokens:
                try:
                    j.source.check_live()
                    tokens = j.source.cells.popleft().tolist()
                    bad = next((t for t in tokens if not 0 <= t < sm.info.vocab_size), None)
                    if bad is not None:
                        raise PieError(ErrorCode.TOKEN_OUT_OF_RANGE, f"channel token {bad} outside the vocab")
                    j.tokens = tokens
                except PieError as e:
                    replies.append(self._fail(sm, j, e))
        return replies

    def _flagged(self, j: FireJob) -> bool:
        ch = self.channels.channels.get(j.run.spec.stop_channel) if j.run.spec.stop_channel is not None else None
        return bool(ch is not None and ch.cells and ch.cells[0].any())

    def _execute(self, sm: ServedModel, chunks: list[Chunk]) -> list[tuple[FireJob, list[dict], object]]:
        """One forward over the chunks, then the readouts and epilogues of the fires it finished. Each
        finished fire comes with its outcome: (device fold or None, Txn or None), or the PieError it raised."""
        segments, tokens, positions = [], [], []
        for c in chunks:
            j = c.job
            segments.append(Segment(j.ws.pages, j.start + j.done, c.rows))
            tokens.extend(j.tokens[j.done : j.done + c.rows])
            positions.extend(j.positions[j.done : j.done + c.rows])
        t0 = time.perf_counter()
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
        requests = [
            ReadoutRequest(r, torch.stack([j.hidden[row] for row in r.rows]), mask,
                           [j.tokens[row + 1] if row + 1 < len(j.tokens) else -1 for row in r.rows]
                           if r.at_accepted else None)
            for j in finished
            for r, mask in zip(j.readouts, j.masks)
            if r.rows
        ]
        results, raw = sm.runner.readouts(requests) if requests else ([], [])
        t1 = time.perf_counter()
        self.stats.forward_s += t1 - t0
        self.stats.rows += len(tokens)
        it = iter(zip(results, raw))
        out = []
        for j in finished:
            answered, logits = [], {}
            for r in j.readouts:
                res, lg = next(it) if r.rows else ({}, None)
                answered.append(res)
                if lg is not None:
                    logits[tuple(r.rows)] = lg
            out.append((j, answered, self._epilogue(sm, j, logits)))
        self.stats.epilogue_s += time.perf_counter() - t1
        return out

    def _epilogue(self, sm: ServedModel, j: FireJob, logits: dict[tuple[int, ...], torch.Tensor]) -> object:
        """Runs the fire's program; ``logits`` (readout rows → raw logits) spares it a second lm head."""
        if j.program is None:
            return (None, None)
        txn = Txn(j.bindings)
        try:
            intrinsics = FireIntrinsics(sm.runner, j.hidden, j.tokens, logits)
            fold = run_program(j.program, intrinsics, txn, sm.runner.device)
            if fold is not None and not 0 <= fold <= len(j.tokens):
                raise PieError(ErrorCode.PROGRAM_FAILED, f"the epilogue folds {fold}, outside [0, {len(j.tokens)}]")
            txn.commit()
        except PieError as e:
            return e
        return (fold, txn)

    def _commit(self, sm: ServedModel, finished: list[tuple[FireJob, list[dict], object]]) -> list[Reply]:
        replies = []
        for j, results, outcome in finished:
            if isinstance(outcome, PieError):
                replies.append(self._fail(sm, j, outcome))
                continue
            device_fold, txn = outcome
            ws = j.ws
            fold = j.fold if j.fold is not None else device_fold
            if fold is not None:
                ws.committed = j.start + fold
                if j.fold is None:
                    ws.pending_fold = None  # settled on the device, as ws_fold would
            self.stats.fires += 1
            if j.run is not None:
                out_slot = next(s for s, ch in enumerate(j.bindings) if ch.id == j.run.spec.output)
                j.run.reason = j.run.after_round(txn.puts.get(out_slot, []))
                self._unqueue(sm, j)
                if j.run.reason is None:
                    j.run.reason = self._next_round(sm, j)
                if j.run.reason is not None:
                    replies.append((j.client, self._run_reply(j)))
                continue
            self._unqueue(sm, j)
            wire = [{k: encode_array(v) for k, v in res.items()} for res in results]
            reply = {"id": j.req_id, "ok": True, "results": wire, "committed": ws.committed,
                     "pending_fold": ws.pending_fold}
            if device_fold is not None:
                reply["fold"] = device_fold
            replies.append((j.client, reply))
        return replies

    def _unqueue(self, sm: ServedModel, j: FireJob) -> None:
        sm.queue.remove(j)
        j.ws.in_flight -= 1
        if not j.ws.in_flight and j.ws.pending_fold is None:  # else rows past committed may still fold
            self._trim(j.ws)

    def _next_round(self, sm: ServedModel, j: FireJob) -> str | None:
        """Queues the next round of a run-ahead; returns why it cannot, if it cannot."""
        ws, w = j.ws, len(j.positions)
        start = ws.committed
        if start + w > sm.info.max_positions:
            return "capacity"
        try:
            self._reserve_pages(ws, sm, start, w)
        except PieError as e:
            return e.code.value
        nxt = FireJob(j.client, j.req_id, ws, [], list(range(start, start + w)), [], [], None, start,
                      program=j.program, bindings=j.bindings, source=j.source, run=j.run)
        self._enqueue(sm, nxt)
        return None

    def _run_reply(self, j: FireJob) -> dict:
        return {"id": j.req_id, "ok": True, "results": [], "committed": j.ws.committed, "pending_fold": None,
                "run": j.run.summary()}

    def _finish(self, sm: ServedModel, j: FireJob, reply: dict) -> Reply:
        """Ends a fire that will not run (a stopped run-ahead round): its rows were never written."""
        if j.fold is None:
            j.ws.pending_fold = None
        self._unqueue(sm, j)
        return (j.client, reply)

    def _fail(self, sm: ServedModel, j: FireJob, err: PieError) -> Reply:
        """A failed fire: its channel writes are dropped and those channels poisoned. A deferred (device)
        fold folds nothing; a fold the host fixed still applies, since later queued fires count on it."""
        poison(j.writes, err)
        if j.fold is not None and j.done:
            j.ws.committed = j.start + j.fold
        reply = {"id": j.req_id, "ok": False, "error": err.to_wire()}
        return self._finish(sm, j, reply)
