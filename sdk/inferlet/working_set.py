"""WorkingSet handles: a sequence's KV state in the engine, named by a handle, never by pages."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import Model


class WorkingSet:
    """Rows ``0 .. committed-1`` are frozen; a fire writes after them and its fold commits some of its rows.

    Opened lazily: the engine learns of it on its first fire or fork.
    """

    def __init__(self, model: Model, handle: int | None = None, committed: int = 0):
        self.model = model
        self._handle = handle
        self.committed = committed
        self.pending_fold = False
        self.released = False
        self._settle: int | list[int] | None = None  # a fold (count or tree path) to settle with the next fire
        self.cached_rows = 0  # rows of its fires the engine took from its prefix cache (a fire reply's cached_rows)
        self.step_rows = 0  # rows of the engine step its last fire ran in, its own included (the engine's load)
        # rows the engine replayed to fold fewer rows than a fire ran, so far (models with recurrent state)
        self.replayed_rows = 0

    async def handle(self) -> int:
        if self._handle is None:
            reply = await self.model.client.request("ws_open", model=self.model.name)
            self._handle = reply["ws"]
        return self._handle

    async def fork(self) -> WorkingSet:
        """A new working set sharing this one's committed rows copy-on-write."""
        await self._flush_settle()
        reply = await self.model.client.request("ws_fork", ws=await self.handle())
        return WorkingSet(self.model, reply["ws"], reply["committed"])

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

    async def release(self) -> None:
        if self._handle is not None and not self.released:
            await self.model.client.request("ws_release", ws=self._handle)
        self.released = True


def _count(fold: int | list[int]) -> int:
    return fold if isinstance(fold, int) else len(fold)
