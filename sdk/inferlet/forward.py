"""ForwardPass: one fire over a working set's window: embed tokens, choose readouts, choose the fold."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pie_runtime.protocol.arrays import decode_array, encode_array

from .readouts import ReadoutKind, to_wire
from .working_set import WorkingSet

DEFERRED = "deferred"


@dataclass
class ReadoutResult:
    """One readout's arrays, one entry per readout row."""

    kind: str
    logits: np.ndarray | None = None  # (rows, vocab) float32
    tokens: np.ndarray | None = None  # (rows,) int32, or (rows, k) for MTP
    probs: np.ndarray | None = None  # (rows, vocab), or (rows, k, vocab) for MTP with_probs
    hidden: np.ndarray | None = None  # (rows, hidden)


@dataclass
class PassResult:
    readouts: list[ReadoutResult] = field(default_factory=list)
    committed: int = 0

    def _cat(self, name: str) -> np.ndarray | None:
        parts = [getattr(r, name) for r in self.readouts if getattr(r, name) is not None]
        return np.concatenate(parts) if parts else None

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
    def __init__(self, ws: WorkingSet):
        self.ws = ws
        self._tokens: list[int] = []
        self._positions: list[int] | None = None
        self._readouts: list[dict] = []
        self._fold: int | str | None = None

    def embed(self, token_ids, positions=None) -> "ForwardPass":
        """Appends rows to the window (written after the working set's committed rows)."""
        ids = [int(t) for t in token_ids]
        if positions is not None:
            pos = [int(p) for p in positions]
            if len(pos) != len(ids):
                raise ValueError("one position per token")
            base = self._positions if self._positions is not None else self._default_positions()
            self._positions = base + pos
        elif self._positions is not None:
            self._positions += list(range(self.ws.committed + len(self._tokens),
                                          self.ws.committed + len(self._tokens) + len(ids)))
        self._tokens += ids
        return self

    def _default_positions(self) -> list[int]:
        return list(range(self.ws.committed, self.ws.committed + len(self._tokens)))

    def readout(self, rows, kind: ReadoutKind, mask: np.ndarray | None = None) -> "ForwardPass":
        """Reads ``kind`` at window rows ``rows``; ``mask`` is a packed allowed-token bitmask per row
        (int32, (len(rows), ceil(vocab / 32)), bit i of word j allows token 32 j + i)."""
        spec = {"rows": [int(r) for r in rows], **to_wire(kind)}
        if mask is not None:
            spec["mask"] = encode_array(np.ascontiguousarray(mask, dtype=np.int32).reshape(len(spec["rows"]), -1))
        self._readouts.append(spec)
        return self

    def fold(self, n: int | str) -> "ForwardPass":
        """How many rows to commit: an int, or DEFERRED to settle later with ``ws.fold(n)``."""
        self._fold = n
        return self

    async def submit(self) -> PassResult:
        handle = await self.ws.handle()
        fields: dict = {"ws": handle, "tokens": self._tokens, "readouts": self._readouts, "fold": self._fold}
        if self._positions is not None:
            fields["positions"] = self._positions
        reply = await self.ws.model.client.request("fire", **fields)
        self.ws.committed = reply["committed"]
        self.ws.pending_fold = reply.get("pending_fold") is not None
        results = [
            ReadoutResult(kind=spec["kind"], **{k: decode_array(v) for k, v in res.items()})
            for spec, res in zip(self._readouts, reply["results"])
        ]
        return PassResult(results, reply["committed"])
