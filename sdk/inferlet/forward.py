"""ForwardPass: one fire over a working set's window: embed tokens, choose readouts, choose the fold. A window
may be a token tree (``tree(parents)``, pie_runtime.protocol.tree), folded by a path of its rows."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from pie_runtime.protocol import ErrorCode, PieError
from pie_runtime.protocol.arrays import decode_array, encode_array
from pie_runtime.protocol.messages import DEFERRED  # re-exported: inferlet.DEFERRED, forward.DEFERRED

from .channels import Channel
from .programs import Program
from .readouts import ReadoutSpec, to_wire
from .working_set import WorkingSet


@dataclass
class ReadoutResult:
    """One readout's arrays, one entry per readout row."""

    kind: str
    logits: np.ndarray | None = None  # (rows, vocab) float32
    tokens: np.ndarray | None = None  # (rows,) int32, or (rows, k) for MTP
    probs: np.ndarray | None = None  # (rows, vocab), or (rows, k, vocab) for MTP with_probs
    hidden: np.ndarray | None = None  # (rows, hidden)
    scores: np.ndarray | None = None  # AttentionScores: (rows, keys), or (rows, layers, keys) per layer


@dataclass
class PassResult:
    """A fire's answer. ``res.tokens`` (and ``logits``, ``probs``, ``hidden``) join that array over the
    readouts that have it, in readout order; readouts whose rows differ in shape (Argmax's (R,) beside
    MTP's (R, 1+k)) cannot be joined: read those from ``res.readouts[i]``."""

    readouts: list[ReadoutResult] = field(default_factory=list)
    committed: int = 0
    fold: int | None = None  # the fold count the epilogue chose, when it folds
    fold_path: list[int] | None = None  # ... and, in a tree window, the path of rows it folded
    run: dict | None = None  # a run-ahead's {rounds, tokens, reason}
    cached_rows: int = 0  # window rows the engine took from its prefix cache instead of computing them

    def _cat(self, name: str) -> np.ndarray | None:
        with_it = [(i, r) for i, r in enumerate(self.readouts) if getattr(r, name) is not None]
        if not with_it:
            return None
        if len(with_it) == 1:
            return getattr(with_it[0][1], name)
        if len({getattr(r, name).shape[1:] for _, r in with_it}) > 1:
            shapes = ", ".join(f"readouts[{i}] ({r.kind}) {getattr(r, name).shape}" for i, r in with_it)
            raise ValueError(
                f"cannot join {name} of differently shaped readouts: {shapes}; read res.readouts[i].{name}"
            )
        return np.concatenate([getattr(r, name) for _, r in with_it])

    @property
    def logits(self) -> np.ndarray | None:
        return self._cat("logits")

    @property
    def tokens(self) -> np.ndarray | None:
        return self._cat("tokens")

    @property
    def probs(self) -> np.ndarray | None:
        return self._cat("probs")

    @property
    def hidden(self) -> np.ndarray | None:
        return self._cat("hidden")


class ForwardPass:
    """One fire of the model over a working set: ``embed`` the window's tokens, ``readout`` what to read at
    which rows, optionally ``fold`` (how many rows to commit; all of them by default, or ``DEFERRED``),
    ``tree`` or ``epilogue``; then ``await submit()`` for the :class:`PassResult`. Each setter returns the pass,
    so calls chain."""

    def __init__(self, ws: WorkingSet):
        self.ws = ws
        self._tokens: list[int] = []
        self._positions: list[int] | None = None
        self._readouts: list[dict] = []
        self._fold: int | list[int] | str | None = None
        self._parents: list[int] | None = None
        self._source: Channel | None = None
        self._program: Program | None = None
        self._bindings: list[Channel] = []
        self._run_ahead: dict | None = None

    def embed(self, token_ids, positions=None) -> ForwardPass:
        """Appends rows to the window (written after the working set's committed rows)."""
        ids = [int(t) for t in token_ids]
        if positions is not None:
            pos = [int(p) for p in positions]
            if len(pos) != len(ids):
                raise ValueError("one position per token")
            base = self._positions if self._positions is not None else self._default_positions()
            self._positions = base + pos
        elif self._positions is not None:
            self._positions += list(
                range(self.ws.position + len(self._tokens), self.ws.position + len(self._tokens) + len(ids))
            )
        self._tokens += ids
        return self

    def _default_positions(self) -> list[int]:
        return list(range(self.ws.position, self.ws.position + len(self._tokens)))

    def readout(self, rows, kind: ReadoutSpec, mask: np.ndarray | None = None) -> ForwardPass:
        """Reads ``kind`` at window rows ``rows``; ``mask`` is a packed allowed-token bitmask per row
        (int32, (len(rows), ceil(vocab / 32)), bit i of word j allows token 32 j + i)."""
        spec = {"rows": [int(r) for r in rows], **to_wire(kind)}
        if mask is not None:
            spec["mask"] = encode_array(np.ascontiguousarray(mask, dtype=np.int32).reshape(len(spec["rows"]), -1))
        self._readouts.append(spec)
        return self

    def tree(self, parents) -> ForwardPass:
        """Makes the window a token tree: ``parents[i]`` is the window row row i follows (-1: the committed
        sequence), before it. Row i sits at position committed + its depth and attends its ancestors only;
        the fire folds nothing unless ``fold`` names a path."""
        self._parents = [int(p) for p in parents]
        return self

    def fold(self, n: int | list[int] | str) -> ForwardPass:
        """What to commit: a count of leading rows, a path of a tree window's rows (root first), or DEFERRED to
        settle later with ``ws.fold(n)`` or ``ws.settle(n)``."""
        self._fold = n if isinstance(n, (int, str)) else [int(r) for r in n]
        return self

    def embed_from(self, channel: Channel) -> ForwardPass:
        """Takes the window's tokens from the front cell of ``channel`` (a 1-d int channel) when the fire runs."""
        if self._tokens:
            raise ValueError("a window comes from tokens or from a channel, not both")
        self._source = channel
        return self

    def epilogue(self, program: Program, bindings: list[Channel] | None = None) -> ForwardPass:
        """Runs ``program`` on the device right after the forward. A program that folds decides the fold."""
        self._program = program
        self._bindings = list(program.channels if bindings is None else bindings)
        if program.folds:
            self._fold = DEFERRED
        return self

    def run_ahead(
        self,
        output: Channel,
        budget_tokens: int | None = None,
        budget_rounds: int | None = None,
        stop_tokens=(),
        stop_channel: Channel | None = None,
    ) -> ForwardPass:
        """Leaves this pass with the engine: it re-fires it step after step until a budget, a stop token
        in ``output`` or a nonzero ``stop_channel``. ``submit()`` returns when it has stopped; meanwhile take
        the committed tokens from ``output``."""
        self._run_ahead = {
            "output": output.handle,
            "budget_tokens": budget_tokens,
            "budget_rounds": budget_rounds,
            "stop_tokens": [int(t) for t in stop_tokens],
            "stop_channel": None if stop_channel is None else stop_channel.handle,
        }
        return self

    async def submit(self) -> PassResult:
        return await (await self.launch())

    async def launch(self) -> asyncio.Task[PassResult]:
        """Sends the fire and returns at once with a task for its result: a run-ahead answers only when it
        stops, and takes from its channels sent after ``launch`` returns wait for it rather than find them
        empty."""
        handle = await self.ws.handle()
        fields: dict = {"ws": handle, "readouts": self._readouts, "fold": self._fold}
        settle = self.ws.take_settle()
        if settle is not None:
            fields["settle"] = settle
        if self._source is not None:
            fields["tokens_from"] = self._source.handle
        else:
            fields["tokens"] = self._tokens
        if self._positions is not None:
            fields["positions"] = self._positions
        if self._parents is not None:
            fields["parents"] = self._parents
        if self._program is not None:
            fields["program"] = await self._program.register()
            fields["bindings"] = [ch.handle for ch in self._bindings]
        if self._run_ahead is not None:
            fields["run_ahead"] = self._run_ahead
        task = asyncio.get_running_loop().create_task(self._result(fields))
        await asyncio.sleep(0)  # lets the task send the request (a zmq send completes at once)
        return task

    async def _fire(self, fields: dict) -> dict:
        """Sends the fire. One refused ``unknown_program`` (the engine evicted the program past its
        ``--max-programs``, or another run on this connection unregistered it) registers the program again and
        sends the fire once more: a refused fire changed nothing, its settle included."""
        client = self.ws.model.client
        try:
            return await client.request("fire", **fields)
        except PieError as e:
            if e.code != ErrorCode.UNKNOWN_PROGRAM or self._program is None:
                raise
        self._program.forget()
        fields["program"] = await self._program.register()
        return await client.request("fire", **fields)

    async def _result(self, fields: dict) -> PassResult:
        reply = await self._fire(fields)
        self.ws.committed = reply["committed"]
        self.ws.pending_fold = reply.get("pending_fold") is not None
        cached = int(reply.get("cached_rows") or 0)  # absent from engines without a prefix cache
        self.ws.cached_rows += cached
        self.ws.step_rows = int(reply.get("step_rows") or 0)
        if "pages" in reply:
            self.ws.held_pages(int(reply["pages"]))
        self.ws.replayed_rows = int(reply.get("replayed_rows") or self.ws.replayed_rows)  # a running total
        results = [
            ReadoutResult(kind=spec["kind"], **{k: decode_array(v) for k, v in res.items()})
            for spec, res in zip(self._readouts, reply["results"])
        ]
        return PassResult(
            results, reply["committed"], reply.get("fold"), reply.get("fold_path"), reply.get("run"), cached
        )
