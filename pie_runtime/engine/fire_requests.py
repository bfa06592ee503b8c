"""The ``fire`` request: a ForwardPass checked in full, its pages reserved, then queued for the next step.

Every check runs before anything changes, so a refused fire leaves no trace; its pages are reserved when
it is accepted, so running out of pages is an immediate typed error, never a stall. A fire may settle its
working set's deferred fold (``settle``), carry an epilogue program over bound channels, take its window
from a channel, and stay with the engine as a run-ahead (docs/architecture.md, "Programs and channels").

Readouts are bounded before any work, so a small message cannot make the lm head allocate without limit:
each readout reads at most ``max(w, MIN_READOUT_ROWS)`` rows (``w`` the fire's window; a row may repeat
within that count, so a short window may still draw several samples of one row) and all the readouts of
one fire at most ``MAX_READOUT_ROWS`` rows (``limit_exceeded``); their replies' bytes at most
``MAX_FIRE_READOUT_BYTES`` a fire, and those of the fires a client's identity has queued at most
``MAX_IDENTITY_READOUT_BYTES`` together (identities.py: a tenant's connections and runs share it). Every row
of a readout's allowed-token mask must allow at least one token of the vocabulary (``empty_mask``), so no
sampler ever sees a row with nothing to choose.
"""

from __future__ import annotations

import numpy as np

from ..protocol import ErrorCode, PieError
from ..protocol import messages as m
from ..protocol.tree import Fold, fold_path, tree_depths
from .fold import settle_fold
from .identities import MAX_FIRE_READOUT_BYTES, MAX_IDENTITY_READOUT_BYTES, Identities, readout_bytes
from .jobs import FireJob, Handler
from .programs import Program
from .programs.requests import ProgramRequests
from .scheduler import MAX_READOUT_ROWS  # one fire's readout rows, all its readouts together (duplicates count)
from .served import ServedModel, ServedModels
from .working_set import WorkingSet, WorkingSetTable

MIN_READOUT_ROWS = 64  # one readout reads at most max(window, this) rows: e.g. 16 samples of a prompt's last row


class FireRequests:
    def __init__(
        self,
        models: ServedModels,
        sets: WorkingSetTable,
        programs: ProgramRequests,
        identities: Identities | None = None,
    ):
        self.models = models
        self.sets = sets
        self.programs = programs
        self.identities = identities or programs.identities

    def ops(self) -> dict[str, Handler]:
        return {"fire": self.fire}

    def fire(self, client: bytes, req: m.Fire) -> None:
        """Queues the fire; its reply comes after the step that finishes it."""
        ws = self.sets.get(client, req.ws)
        settle = ws.check_settle(req.settle) if req.settle is not None else None
        if settle is None and ws.pending_fold is not None:
            raise PieError(ErrorCode.FOLD_PENDING, f"working set {ws.id} has a deferred fold to settle first")
        served = self.models[ws.model]
        source = self.programs.source(client, req, ws)
        w = source.shape[0] if source is not None else len(req.tokens or [])
        start = ws.committed + len(settle) if settle is not None else served.queue.planned_length(ws)
        depths = self._check_tree(served, req, source, w)
        positions = self._check_window(served, req, ws.position(start), w, depths)
        self._check_readout_rows(req, w)
        self._check_attention(served, req, start + w)
        nbytes = self._check_readout_bytes(client, served, req, start + w)
        masks = [self._check_readout(r, w, served, req.parents) for r in req.readouts]
        program, bindings = self.programs.bind(client, req, ws, w)
        fold = self._fold(req, program, w)
        self._check_granule(served, fold, w)
        run = self.programs.check_run_ahead(client, req, program, bindings, source)
        cached = 0
        try:
            if self._may_reuse(ws, req, start):
                assert req.tokens is not None  # _may_reuse asks for token ids
                cached = served.pages.map_prefix(ws, req.tokens, self._reusable_rows(req, program, w))
            moving = fold == w and req.parents is None  # every row folds: its sliding pages may move along
            served.pages.reserve(ws, start + cached, w - cached, moving=moving)
        except PieError:
            if cached:  # the mapped prefix goes back to the cache
                served.pages.release(ws)
            raise  # a refused fire leaves no trace, its settle included: that is applied only below
        if settle is not None:  # reserve copies page contents only, so the settled path's rows are intact
            settle_fold(served, ws, settle)  # with recurrent state, restores and replays here (engine/fold.py)
        served.queue.push(
            FireJob(
                client=client,
                req_id=req.id,
                ws=ws,
                tokens=list(req.tokens or []),
                positions=positions,
                readouts=list(req.readouts),
                masks=masks,
                fold=fold,
                start=start,
                parents=None if req.parents is None else list(req.parents),
                done=cached,
                cached_rows=cached,
                program=program,
                bindings=bindings,
                source=source,
                run=run,
                readout_bytes=nbytes,
            )
        )

    def _check_readout_bytes(self, client: bytes, served: ServedModel, req: m.Fire, width: int) -> int:
        """The bytes of the fire's readout replies, bounded alone (MAX_FIRE_READOUT_BYTES) and beside those of
        the fires its client's identity has queued (MAX_IDENTITY_READOUT_BYTES): replies held until sent."""
        info = served.info
        attention = any(r.kind == "attention" for r in req.readouts)  # _check_attention: the model reads them
        layers = served.runner.model.config.num_hidden_layers if attention else 1
        nbytes = sum(readout_bytes(r, info.vocab_size, info.hidden_size, layers, width) for r in req.readouts)
        if nbytes > MAX_FIRE_READOUT_BYTES:
            raise PieError(
                ErrorCode.LIMIT_EXCEEDED,
                f"MAX_FIRE_READOUT_BYTES: the readouts of one fire reply at most {MAX_FIRE_READOUT_BYTES} bytes, "
                f"these {nbytes}: read fewer rows a fire",
            )
        if not nbytes:
            return 0
        identity = self.identities.of(client)
        queued = sum(job.readout_bytes for job in self.models.jobs() if self.identities.of(job.client) == identity)
        if queued + nbytes > MAX_IDENTITY_READOUT_BYTES:
            raise PieError(
                ErrorCode.LIMIT_EXCEEDED,
                f"MAX_IDENTITY_READOUT_BYTES: the queued fires of a client's identity (all its connections) reply "
                f"at most {MAX_IDENTITY_READOUT_BYTES} bytes of readouts together; they hold {queued} and this "
                f"one asks {nbytes}: wait for their replies",
            )
        return nbytes

    @staticmethod
    def _may_reuse(ws: WorkingSet, req: m.Fire, start: int) -> bool:
        """Whether the fire may map a cached prefix: the first fire of a fresh working set, embedding token ids
        from sequence index 0 at their default positions."""
        return (
            start == 0
            and not ws.pages
            and not ws.dropped
            and not ws.in_flight
            and req.tokens is not None
            and req.settle is None
            and req.parents is None
            and (req.positions is None or req.positions == list(range(len(req.tokens))))
        )

    @staticmethod
    def _reusable_rows(req: m.Fire, program: Program | None, w: int) -> int:
        """Rows a cached prefix may cover: it stops before the window's last row (always computed) and before
        the first row a readout or the epilogue reads the hidden state of."""
        needed = [row for r in req.readouts for row in r.rows] + (list(program.rows) if program is not None else [])
        return min([w - 1, *needed])

    @staticmethod
    def _check_tree(served: ServedModel, req: m.Fire, source: object, w: int) -> list[int] | None:
        """A tree window's row depths (protocol.tree), None for a chain: INVALID_TREE for parents that form no
        tree of the window, LIMIT_EXCEEDED past MAX_TREE_ROWS, UNSUPPORTED for a channel-fed window or a model
        with recurrent state (its state runs through rows in order, not along branches: engine/fold.py)."""
        if req.parents is None:
            return None
        if source is not None:
            raise PieError(ErrorCode.UNSUPPORTED, "a tree window embeds token ids, not a channel's cell")
        if served.states is not None:
            raise PieError(
                ErrorCode.UNSUPPORTED,
                f"model {served.name} carries recurrent state, which advances through a window's rows in order: "
                "a tree fire needs a model with attention only (fire a chain instead)",
            )
        return tree_depths(req.parents, w)

    @staticmethod
    def _check_window(served: ServedModel, req: m.Fire, start: int, w: int, depths: list[int] | None) -> list[int]:
        """The window's positions (a tree row's: ``start``, the position of its first row, plus its depth), once
        its tokens and positions are known to fit the model."""
        info = served.info
        bad = next((t for t in req.tokens or [] if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise PieError(ErrorCode.TOKEN_OUT_OF_RANGE, f"token id {bad} outside vocab [0, {info.vocab_size})")
        if start + w > info.max_positions:
            raise PieError(
                ErrorCode.CAPACITY, f"rows {start}..{start + w - 1} exceed the model's {info.max_positions} positions"
            )
        if req.positions is not None:
            positions = req.positions
        else:
            positions = list(range(start, start + w)) if depths is None else [start + d for d in depths]
        if len(positions) != w or any(not 0 <= p < info.max_positions for p in positions):
            raise PieError(ErrorCode.INVALID_ARGUMENT, "positions need one value per token, each within capacity")
        return positions

    @staticmethod
    def _fold(req: m.Fire, program, w: int) -> Fold | None:
        """The fire's fold (a count, or a path of its tree), or None when it is deferred (to the host or to the
        epilogue). A tree window folds no rows unless told which: its default fold is the empty path."""
        if req.fold == m.DEFERRED:
            return None
        if program is not None and program.folds:
            raise PieError(ErrorCode.INVALID_ARGUMENT, "a fire whose program folds needs fold=deferred")
        if req.fold is None:
            return w if req.parents is None else []
        fold_path(req.fold, req.parents, w)
        return req.fold

    @staticmethod
    def _check_granule(served: ServedModel, fold: Fold | None, w: int) -> None:
        """A model whose state advances in granules of more than one row cannot leave rows of a fire out: its
        state cannot be replayed to a row inside a granule. Only whole fires fold there (no deferred fold)."""
        g = served.info.state_granule
        if g > 1 and (fold is None or (fold if isinstance(fold, int) else len(fold)) < w):
            raise PieError(
                ErrorCode.GRANULE,
                f"model {served.name}'s state advances in granules of {g} rows: a fire folds all its rows "
                f"(asked {'deferred' if fold is None else fold} of {w})",
            )

    @staticmethod
    def _check_readout_rows(req: m.Fire, w: int) -> None:
        """Bounds the rows the fire's readouts read: each at most max(w, MIN_READOUT_ROWS), all together
        MAX_READOUT_ROWS."""
        most = max(w, MIN_READOUT_ROWS)
        for r in req.readouts:
            if len(r.rows) > most:
                raise PieError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"a readout reads at most max(window {w}, MIN_READOUT_ROWS={MIN_READOUT_ROWS}) rows, "
                    f"got {len(r.rows)}",
                )
        total = sum(len(r.rows) for r in req.readouts)
        if total > MAX_READOUT_ROWS:
            raise PieError(
                ErrorCode.LIMIT_EXCEEDED,
                f"the readouts of one fire read at most MAX_READOUT_ROWS={MAX_READOUT_ROWS} rows, got {total}",
            )

    @staticmethod
    def _check_attention(served: ServedModel, req: m.Fire, width: int) -> None:
        """Bounds the attention readouts' replies (float32 (rows, [layers,] width), ``width`` the working set's
        rows up to the window's end) to MAX_ATTENTION_BYTES, all of one fire's together (many readouts of a few
        rows each would otherwise multiply it); refuses them where the model cannot read them."""
        total = 0
        for r in req.readouts:
            if r.kind != "attention":
                continue
            if not served.runner.attention_scores:
                raise PieError(
                    ErrorCode.UNSUPPORTED,
                    f"model {served.name} cannot read attention scores out here (recurrent layers, or a "
                    "tensor-parallel engine)",
                )
            if r.mask is not None:
                raise PieError(ErrorCode.INVALID_ARGUMENT, "an attention readout takes no token mask")
            layers = served.runner.model.config.num_hidden_layers if r.per_layer else 1
            size = 4 * len(r.rows) * layers * width
            total += size
            if total > m.MAX_ATTENTION_BYTES:
                raise PieError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"the attention readouts of this fire (the last: {len(r.rows)} rows x {layers} layer(s) x "
                    f"{width} keys) are {total} bytes, past MAX_ATTENTION_BYTES={m.MAX_ATTENTION_BYTES}: "
                    "read fewer rows a fire",
                )

    @staticmethod
    def _check_readout(r: m.Readout, w: int, served: ServedModel, parents: list[int] | None) -> np.ndarray | None:
        """Checks one readout against the window and the model; returns its mask, if it has one."""
        if any(not 0 <= row < w for row in r.rows):
            raise PieError(ErrorCode.ROW_OUT_OF_RANGE, f"readout rows must lie in the fire's window [0, {w})")
        if r.at_accepted and parents is not None:
            raise PieError(ErrorCode.INVALID_ARGUMENT, "at_accepted reads a chain window, not a tree")
        if r.kind == "mtp" and served.runner.mtp is None:
            raise PieError(ErrorCode.UNSUPPORTED, f"model {served.name} has no MTP drafter")
        if r.kind == "mtp" and r.k > served.info.mtp_depth:
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"MTP({r.k}) past the drafter's depth {served.info.mtp_depth}")
        if r.kind == "eagle" and served.runner.eagle is None:
            raise PieError(ErrorCode.UNSUPPORTED, f"model {served.name} has no EAGLE drafter")
        if r.kind == "eagle" and r.k > served.info.eagle_depth:
            raise PieError(
                ErrorCode.INVALID_ARGUMENT, f"Eagle({r.k}) past the drafter's depth {served.info.eagle_depth}"
            )
        if r.at_accepted and (r.kind not in ("mtp", "eagle") or r.with_probs):
            raise PieError(
                ErrorCode.INVALID_ARGUMENT, "at_accepted is for greedy MTP and Eagle readouts (no with_probs)"
            )
        if r.at_accepted and r.rows and r.rows != list(range(r.rows[0], r.rows[0] + len(r.rows))):
            raise PieError(ErrorCode.INVALID_ARGUMENT, "an at_accepted MTP or Eagle readout reads consecutive rows")
        if r.mask is None:
            return None
        words = (served.info.vocab_size + 31) // 32
        mask = r.mask.to_numpy()
        if mask.dtype not in (np.int32, np.uint32) or mask.shape != (len(r.rows), words):
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"mask must be int32 of shape ({len(r.rows)}, {words})")
        vocab = served.info.vocab_size
        allowed = mask.view(np.uint32)
        if vocab % 32:  # bits past the vocabulary allow nothing
            allowed = allowed.copy()
            allowed[:, -1] &= np.uint32((1 << (vocab % 32)) - 1)
        empty = np.flatnonzero(~allowed.any(axis=1))
        if empty.size:
            raise PieError(
                ErrorCode.EMPTY_MASK, f"readout mask row {int(empty[0])} allows no token of the vocabulary [0, {vocab})"
            )
        return mask
