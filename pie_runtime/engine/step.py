"""The engine step: schedule → execute → commit over the queued fires of every client, once per model.

Schedule picks the chunks of the ready fires (scheduler.py); execute runs one forward over them and the
readouts and epilogues of the fires it finished (execute.py); commit applies their folds, answers them and
re-queues run-aheads. Before scheduling, the step stops flagged run-aheads and hands channel-fed fires their
windows; after it, the host takes that the step's channel writes can answer are answered.

Faults are contained per fire: execute turns what a fire raises into its error outcome, and a fault past that
fails the fires of that model's step, never the engine. A failed fire is answered with its error, poisons the
channels it writes, and returns the pages its unfolded rows took; when its rows did not all run, the later
fires queued on its working set (which count on its fold) fail with it.
"""

from __future__ import annotations

import time

from ..protocol import ErrorCode, PieError
from ..protocol.arrays import encode_array
from ..protocol.tree import fold_path
from .channels import ChannelTable, poison
from .execute import contained, execute
from .fold import apply_fold
from .jobs import FireJob, FireOutcome, Reply, StepStats
from .programs.fire import RunState
from .scheduler import schedule
from .served import ServedModel, ServedModels


class Step:
    def __init__(self, models: ServedModels, channels: ChannelTable, stats: StepStats, max_batch_tokens: int):
        self.models = models
        self.channels = channels
        self.stats = stats
        self.max_batch_tokens = max_batch_tokens

    def has_work(self) -> bool:
        return any(self._runnable(served) for served in self.models)

    def __call__(self) -> list[Reply]:
        """schedule → execute → commit, once per model with runnable fires."""
        t0 = time.perf_counter()
        replies: list[Reply] = []
        for served in self.models:
            replies.extend(self._resolve(served))
            runnable = self._runnable(served)
            if not runnable:
                continue
            chunks = schedule(runnable, self.max_batch_tokens)
            try:
                outcomes = execute(served, chunks, self.stats)
            except Exception as e:  # noqa: BLE001 - past execute's own containment: this step's fires fail
                err = contained(e, "step")
                outcomes = [FireOutcome(c.job, error=err) for c in chunks]
            replies.extend(self._commit(served, outcomes, sum(c.rows for c in chunks)))
        replies.extend(self.channels.serve(self.models.writes))
        self.stats.steps += 1
        self.stats.step_s += time.perf_counter() - t0
        return replies

    # ---- schedule ---------------------------------------------------------------------------------

    def _runnable(self, served: ServedModel) -> list[FireJob]:
        """The queue less the working sets whose oldest fire waits on a channel (no input, no room)."""
        blocked = {id(fire.ws) for fire in served.queue.heads() if not self._ready(fire)}
        return [fire for fire in served.queue if id(fire.ws) not in blocked]

    @staticmethod
    def _ready(fire: FireJob) -> bool:
        if fire.done > fire.cached_rows:  # started: its window and room were there when it began
            return True
        if fire.source is not None and not fire.tokens and not fire.source.cells and fire.source.poison is None:
            return False
        if fire.program is not None:
            for slot, n in fire.program.puts.items():
                ch = fire.bindings[slot]
                room = ch.free + fire.program.takes.get(slot, 0) + (ch is fire.source and not fire.tokens)
                if room < n <= ch.capacity and ch.poison is None:
                    return False  # waits for the host to take; a put that can never fit fails instead
        return True

    def _resolve(self, served: ServedModel) -> list[Reply]:
        """Before a step: stops flagged run-aheads, and takes the input window of channel-fed fires."""
        replies = []
        for fire in served.queue.heads():
            if fire.done > fire.cached_rows or not self._ready(fire):
                continue
            if fire.run is not None and self._flagged(fire.run):
                fire.run.reason = "stop_channel"
                replies.append(self._finish(served, fire, self._run_reply(fire, fire.run)))
            elif fire.source is not None and not fire.tokens:
                try:
                    fire.source.check_live()
                    tokens = fire.source.cells.popleft().tolist()
                    bad = next((t for t in tokens if not 0 <= t < served.info.vocab_size), None)
                    if bad is not None:
                        raise PieError(ErrorCode.TOKEN_OUT_OF_RANGE, f"channel token {bad} outside the vocab")
                    fire.tokens = tokens
                except PieError as e:
                    replies.extend(self._fail(served, fire, e))
        return replies

    def _flagged(self, run: RunState) -> bool:
        ch = self.channels.channels.get(run.spec.stop_channel) if run.spec.stop_channel is not None else None
        return bool(ch is not None and ch.cells and ch.cells[0].any())

    # ---- commit -----------------------------------------------------------------------------------

    def _commit(self, served: ServedModel, outcomes: list[FireOutcome], step_rows: int) -> list[Reply]:
        replies = []
        for o in outcomes:
            fire, ws = o.job, o.job.ws
            if o.error is not None:
                replies.extend(self._fail(served, fire, o.error))
                continue
            self._wrote(served, fire)
            if fire.fold is not None:
                apply_fold(served, ws, fire.start, fold_path(fire.fold, fire.parents, len(fire.positions)), fire.tree)
            elif o.device_fold is not None:  # settled on the device, as ws_fold would
                ws.pending_fold, ws.pending_tree = None, None
                apply_fold(served, ws, fire.start, o.device_fold, fire.tree)
            self.stats.fires += 1
            self._unqueue(served, fire)
            if fire.run is not None:
                reply = self._end_round(served, fire, fire.run, o)
                if reply is not None:
                    replies.append((fire.client, reply))
                continue
            wire = [{k: encode_array(v) for k, v in res.items()} for res in o.results]
            reply = {
                "id": fire.req_id,
                "ok": True,
                "results": wire,
                "committed": ws.committed,
                "pending_fold": ws.pending_fold,
                "cached_rows": fire.cached_rows,
                "step_rows": step_rows,  # the batch this fire ran in: what a draft-length planner sees as load
                "pages": served.pages.held(ws),  # KV pages the working set holds now, every page group's
            }
            if o.device_fold is not None:
                reply["fold"] = len(o.device_fold)
                if fire.parents is not None:
                    reply["fold_path"] = o.device_fold
            if ws.state is not None:  # rows this working set's folds replayed so far (engine/fold.py)
                reply["replayed_rows"] = ws.replayed_rows
            replies.append((fire.client, reply))
        return replies

    def _end_round(self, served: ServedModel, fire: FireJob, run: RunState, o: FireOutcome) -> dict | None:
        """After a run-ahead round: queues the next one, or returns the run's reply when it stops."""
        out_slot = next(s for s, ch in enumerate(fire.bindings) if ch.id == run.spec.output)
        run.reason = run.after_round(o.txn.puts.get(out_slot, []) if o.txn is not None else [])
        if run.reason is None:
            run.reason = self._next_round(served, fire)
        return self._run_reply(fire, run) if run.reason is not None else None

    @staticmethod
    def _wrote(served: ServedModel, fire: FireJob) -> None:
        """Tells the prefix cache what the fire's rows now hold: token ids at their default positions can be
        named; a channel-fed window or explicit positions cannot."""
        default = fire.positions == list(range(fire.start, fire.start + len(fire.positions)))
        served.pages.wrote(fire.ws, fire.start, fire.tokens if fire.source is None and default else None)

    def _unqueue(self, served: ServedModel, fire: FireJob) -> None:
        served.queue.pop(fire)
        if not fire.ws.in_flight and fire.ws.pending_fold is None:  # else rows past committed may still fold
            served.pages.trim(fire.ws)

    def _next_round(self, served: ServedModel, fire: FireJob) -> str | None:
        """Queues the next round of a run-ahead; returns why it cannot, if it cannot."""
        ws, w = fire.ws, len(fire.positions)
        start = ws.committed
        if ws.position(start) + w > served.info.max_positions:
            return "capacity"
        try:
            served.pages.reserve(ws, start, w)
        except PieError as e:
            return e.code.value
        served.queue.push(
            FireJob(
                client=fire.client,
                req_id=fire.req_id,
                ws=ws,
                tokens=[],
                positions=list(range(ws.position(start), ws.position(start) + w)),
                readouts=[],
                masks=[],
                fold=None,
                start=start,
                program=fire.program,
                bindings=fire.bindings,
                source=fire.source,
                run=fire.run,
            )
        )
        return None

    @staticmethod
    def _run_reply(fire: FireJob, run: RunState) -> dict:
        reply = {
            "id": fire.req_id,
            "ok": True,
            "results": [],
            "committed": fire.ws.committed,
            "pending_fold": None,
            "run": run.summary(),
        }
        if fire.ws.state is not None:
            reply["replayed_rows"] = fire.ws.replayed_rows
        return reply

    def _finish(self, served: ServedModel, fire: FireJob, reply: dict) -> Reply:
        """Ends a fire that will not run (a stopped run-ahead round): its rows were never written."""
        if fire.fold is None:
            fire.ws.pending_fold, fire.ws.pending_tree = None, None
        self._unqueue(served, fire)
        return (fire.client, reply)

    def _fail(self, served: ServedModel, fire: FireJob, err: PieError) -> list[Reply]:
        """A failed fire: its channel writes are dropped and those channels poisoned. A deferred (device)
        fold folds nothing; a fold the host fixed still applies when all its rows ran, since later queued
        fires count on it. When they did not all run (the forward failed, or the window never came), those
        later fires of its working set fail too: their rows would sit past rows never written."""
        poison(fire.writes, err)
        ran = bool(fire.tokens) and fire.remaining == 0
        if fire.fold is not None and ran:
            self._wrote(served, fire)
            apply_fold(served, fire.ws, fire.start, fold_path(fire.fold, fire.parents, len(fire.positions)), fire.tree)
        elif fire.ws.state is not None and fire.ws.state.fire is fire:
            apply_fold(
                served, fire.ws, fire.ws.committed, []
            )  # its rows fold nothing: the state from before it comes back
        replies = [self._finish(served, fire, {"id": fire.req_id, "ok": False, "error": err.to_wire()})]
        if fire.fold is not None and not ran:
            after = PieError(
                err.code, f"an earlier fire on working set {fire.ws.id} failed before its rows ran: {err.message}"
            )
            for k in [k for k in served.queue if k.ws is fire.ws]:
                poison(k.writes, after)
                replies.append(self._finish(served, k, {"id": k.req_id, "ok": False, "error": after.to_wire()}))
        return replies
