"""WorkingSet handles: a sequence's KV state in the engine, named by a handle, never by pages."""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pie_runtime.protocol import decode_array, encode_array
from pie_runtime.protocol.messages import KV_WIRE_DTYPES, MAX_KV_TRANSFER_BYTES

from .kv_file import SavedKV, write_saved

CACHE_SALT: ContextVar[str | None] = ContextVar("pie_cache_salt", default=None)
"""The prefix-cache salt of the run in this context (``runtime.run_in_context``; ``pie serve`` gives each API
key one): the working sets it opens share cached prefixes only with those opened under the same salt. An
inferlet that keeps state across runs (a shared index) keys it by ``CACHE_SALT.get()`` to keep tenants apart."""

if TYPE_CHECKING:
    from .model import Model


class WorkingSet:
    """Rows ``0 .. committed-1`` are frozen; a fire writes after them and its fold commits some of its rows.

    Opened lazily: the engine learns of it on its first fire or fork. :meth:`evict` drops committed rows (their
    pages go back to the engine's pool); the kept rows keep the positions they were written at, and the next
    row's position is :attr:`position`, the sequence's logical length (``committed + dropped``).
    """

    def __init__(self, model: Model, handle: int | None = None, committed: int = 0):
        self.model = model
        self._handle = handle
        self.committed = committed
        self.dropped = 0  # committed rows evicted so far
        self.pages = 0  # KV pages it holds in the engine, as its last fire or eviction said
        self.pages_max = 0  # the most it held at once
        self.pending_fold = False
        self.released = False
        self._settle: int | list[int] | None = None  # a fold (count or tree path) to settle with the next fire
        self.cached_rows = 0  # rows of its fires the engine took from its prefix cache (a fire reply's cached_rows)
        self.step_rows = 0  # rows of the engine step its last fire ran in, its own included (the engine's load)
        # rows the engine replayed to fold fewer rows than a fire ran, so far (models with recurrent state)
        self.replayed_rows = 0

    async def handle(self) -> int:
        if self._handle is None:
            salt = CACHE_SALT.get()
            extra = {"cache_salt": salt} if salt else {}
            reply = await self.model.client.request("ws_open", model=self.model.name, **extra)
            self._handle = reply["ws"]
        return self._handle

    async def fork(self) -> WorkingSet:
        """A new working set sharing this one's committed rows copy-on-write."""
        await self._flush_settle()
        reply = await self.model.client.request("ws_fork", ws=await self.handle())
        child = WorkingSet(self.model, reply["ws"], reply["committed"])
        child.dropped = self.dropped
        return child

    @property
    def position(self) -> int:
        """The position the next row is written at: rows kept plus rows ever evicted."""
        return self.committed + self.dropped

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV the engine holds for it (``pages`` of ``ModelInfo.page_bytes``: every page group's pages
        are alike, so a sliding-window model's window-sized groups count what they hold)."""
        return self.pages * self.model.info.page_bytes

    @property
    def kv_bytes_max(self) -> int:
        return self.pages_max * self.model.info.page_bytes

    def held_pages(self, pages: int) -> None:
        """Notes the engine's count of the pages this working set holds (a fire or eviction reply's)."""
        self.pages = pages
        self.pages_max = max(self.pages_max, pages)

    async def evict(self, rows=(), ranges=()) -> int:
        """Drops committed rows: ``rows`` (indices) and ``ranges`` (``(start, stop)`` pairs, stop excluded).
        The rows after them close the gaps, keeping their positions; pages no kept row lives in go back to the
        engine's pool at once, and dropping whole pages copies nothing. Returns the rows kept.

            # StreamingLLM: keep 4 sink rows and the last 252 rows
            if ws.committed > 256:
                await ws.evict(ranges=[(4, ws.committed - 252)])
        """
        await self._flush_settle()
        spans = [[int(a), int(b)] for a, b in ranges]
        reply = await self.model.client.request(
            "ws_evict", ws=await self.handle(), rows=[int(r) for r in rows], ranges=spans
        )
        self.committed, self.dropped = reply["committed"], reply["dropped"]
        self.held_pages(int(reply["pages"]))
        return self.committed

    def settle(self, n: int | list[int]) -> None:
        """Settles a deferred fold with the next fire instead of a message of its own: commits the first
        ``n`` rows of the last fire, or the path of rows ``n`` of its tree (``await fold(n)`` does it at once)."""
        if not self.pending_fold or self._settle is not None:
            raise RuntimeError("no deferred fold to settle")
        self._settle, self.committed, self.pending_fold = n, self.committed + _count(n), False

    def take_settle(self) -> int | list[int] | None:
        """The fold the next fire must carry (and forget)."""
        n, self._settle = self._settle, None
        return n

    async def _flush_settle(self) -> None:
        n = self.take_settle()
        if n is not None:
            self.committed -= _count(n)
            self.pending_fold = True
            await self.fold(n)

    async def fold(self, n: int | list[int]) -> int:
        """Settles a deferred fold: commits the first ``n`` rows of the last fire, or the path of rows ``n`` of
        its tree."""
        reply = await self.model.client.request("ws_fold", ws=await self.handle(), n=n)
        self.committed, self.pending_fold = reply["committed"], False
        self.replayed_rows = int(reply.get("replayed_rows") or self.replayed_rows)
        return self.committed

    async def truncate(self, n: int) -> int:
        """Drops the committed suffix past ``n`` rows."""
        await self._flush_settle()
        reply = await self.model.client.request("ws_truncate", ws=await self.handle(), n=n)
        self.committed = reply["committed"]
        return self.committed

    async def save(
        self,
        path: str | Path,
        tokens: Sequence[int],
        pending: Sequence[int] = (),
        positions: Sequence[int] | None = None,
    ) -> SavedKV:
        """Writes this working set's committed rows to ``path`` (safetensors, inferlet/kv_file.py): their K/V as
        the engine's pool holds them, read a bounded range per message, with ``tokens`` (the token of each row),
        ``pending`` (tokens still to embed to go on), the positions where known, and the model's digest, weight
        format and KV dtype, so that only the same model in the same format loads it
        (:meth:`Model.load_working_set`, in this engine or another one). Returns what was saved.

            ws = model.working_set()
            await inferlet.ForwardPass(ws).embed(prompt[:-1]).submit()
            await ws.save("prompt.kv", tokens=prompt[:-1], pending=prompt[-1:])
        """
        await self._flush_settle()
        if len(tokens) != self.committed:
            raise ValueError(f"{len(tokens)} tokens for the {self.committed} committed rows of the working set")
        if self.dropped and not self.committed:
            raise ValueError("every row of the working set was evicted: there is nothing to save")
        if positions is None and not self.dropped:
            positions = range(self.committed)  # never evicted: each row sits at its index
        ks, vs, start = [], [], 0
        info = self.model.info
        windows, held = info.layer_windows, [0] * len(info.layer_windows)
        while start < self.committed:
            reply = await self.model.client.request(
                "ws_read_kv", ws=await self.handle(), start=start, count=self.committed - start
            )
            ks.append(decode_array(reply["k"]))
            vs.append(decode_array(reply["v"]))
            windows, held = reply.get("layer_windows", windows), reply.get("held_from", held)
            start += ks[-1].shape[2]
        empty = np.zeros((0, 0, 0, 0), dtype=KV_WIRE_DTYPES.get(info.kv_dtype, "float32"))
        meta = {
            "page_windows": json.dumps(info.page_windows),
            "layer_windows": json.dumps(windows),
            "held_from": json.dumps(held),
            "model": info.name,
            "model_digest": info.weights_digest,
            "weights": info.weights,
            "kv_dtype": info.kv_dtype,
            "committed": str(self.committed),
            "dropped": str(self.dropped),
        }
        saved = SavedKV(
            k=np.concatenate(ks, axis=2) if ks else empty,
            v=np.concatenate(vs, axis=2) if vs else empty,
            tokens=[int(t) for t in tokens],
            pending=[int(t) for t in pending],
            positions=None if positions is None else [int(p) for p in positions],
            dropped=self.dropped,
            meta=meta,
        )
        write_saved(path, saved)
        return saved

    async def append_saved(self, saved: SavedKV) -> None:
        """Appends ``saved``'s rows to this (idle) working set, a bounded number of rows per message, and takes
        its dropped count, so the next row's position is where it was saved (Model.load_working_set)."""
        step = max(1, MAX_KV_TRANSFER_BYTES // max(2 * saved.k[:, :, :1].nbytes, 1))
        held = saved.held_from
        for start in range(0, saved.rows, step):
            reply = await self.model.client.request(
                "ws_append_kv",
                ws=await self.handle(),
                k=encode_array(saved.k[:, :, start : start + step]),
                v=encode_array(saved.v[:, :, start : start + step]),
                kv_dtype=saved.kv_dtype,
                dropped=saved.dropped,
                held_from=None if held is None else [max(0, h - start) for h in held],
            )
            self.committed, self.dropped = reply["committed"], reply["dropped"]
            self.held_pages(int(reply["pages"]))

    async def release(self) -> None:
        if self._handle is not None and not self.released:
            await self.model.client.request("ws_release", ws=self._handle)
        self.released = True


def _count(fold: int | list[int]) -> int:
    return fold if isinstance(fold, int) else len(fold)
