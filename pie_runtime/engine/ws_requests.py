"""The working-set requests: ``ws_open``, ``ws_fork``, ``ws_release``, ``ws_fold``, ``ws_truncate``,
``ws_evict``, and the release of a departed client's working sets. Each checks everything before it changes
anything. A working set of a model with recurrent state holds a state slot (engine/state_slots.py): open takes
one, fork copies the parent's state into another, release frees it; truncate and evict, which would need the
state without some rows, are refused.

A client's identity (identities.py: all the connections of one tenant) holds at most ``MAX_WORKING_SETS``
working sets at once (open and fork refuse more with ``limit_exceeded``), so one tenant cannot grow the
engine's tables without bound by opening more connections. Its evicts' rows and ranges between two steps are
bounded too (``MAX_IDENTITY_EVICT_SPANS``)."""

from __future__ import annotations

from ..protocol import ErrorCode, PieError
from ..protocol import messages as m
from .channels import ChannelTable
from .fold import settle_fold
from .identities import Identities
from .jobs import Handler, Reply
from .prefix_cache import salted_root
from .served import ServedModels
from .working_set import WorkingSet, WorkingSetTable

MAX_WORKING_SETS = 4096  # per identity


class WorkingSetRequests:
    def __init__(
        self,
        models: ServedModels,
        sets: WorkingSetTable,
        outbox: list[Reply],
        channels: ChannelTable | None = None,
        identities: Identities | None = None,
    ):
        self.models = models
        self.sets = sets
        self.outbox = outbox  # replies owed to the fires a release drops, and to the takes it settles
        self.channels = channels
        self.identities = identities or Identities()
        self._held: dict[str, int] = {}  # identity → working sets its clients hold

    def ops(self) -> dict[str, Handler]:
        return {
            "ws_open": self.open,
            "ws_fork": self.fork,
            "ws_release": self.release_request,
            "ws_fold": self.fold,
            "ws_truncate": self.truncate,
            "ws_evict": self.evict,
        }

    def open(self, client: bytes, req: m.WsOpen) -> dict:
        served = self.models.get(req.model)
        self._check_room(client)
        hold = served.states.open() if served.states is not None else None  # out_of_state_slots before any change
        ws = self.sets.open(client, served.name, tables=served.pages.empty_tables())
        ws.state = hold
        if served.pages.cache is not None:  # its prefix-cache entries are its salt's own (prefix_cache.py)
            ws.chain.root = salted_root(served.pages.cache.root, req.cache_salt)
        self._count(client, +1)
        return {"ws": ws.id, "model": served.name, "committed": 0}

    def fork(self, client: bytes, req: m.WsFork) -> dict:
        parent = self.sets.idle(client, req.ws)
        self._check_room(client)
        served = self.models[parent.model]
        kv = served.pages
        hold = served.states.fork(parent.state) if served.states is not None and parent.state is not None else None
        tables = kv.fork(parent)
        child = self.sets.open(client, parent.model, tables=tables, committed=parent.committed)
        child.state = hold
        child.dropped = parent.dropped  # its rows sit where the parent's do
        child.held_from = parent.held_from
        child.chain = parent.chain.prefix(parent.committed, kv.page_size)
        child.drafter_tail = parent.drafter_tail  # read-only: the child's first row finds its parent's last
        self._count(client, +1)
        return {"ws": child.id, "committed": child.committed}

    def _check_room(self, client: bytes) -> None:
        if self._held.get(self.identities.of(client), 0) >= MAX_WORKING_SETS:
            raise PieError(
                ErrorCode.LIMIT_EXCEEDED,
                f"MAX_WORKING_SETS: a client's identity (all its connections) holds at most {MAX_WORKING_SETS} "
                "working sets; release one first",
            )

    def _count(self, client: bytes, change: int) -> None:
        identity = self.identities.of(client)
        held = self._held.get(identity, 0) + change
        if held > 0:
            self._held[identity] = held
        else:
            self._held.pop(identity, None)

    def release_request(self, client: bytes, req: m.WsRelease) -> dict:
        self.release(self.sets.get(client, req.ws))
        return {}

    def fold(self, client: bytes, req: m.WsFold) -> dict:
        ws = self.sets.get(client, req.ws)
        path = ws.check_settle(req.n)
        served = self.models[ws.model]
        settle_fold(served, ws, path)
        served.pages.trim(ws)
        reply = {"committed": ws.committed}
        if ws.state is not None:  # rows this working set's folds replayed so far (engine/fold.py)
            reply["replayed_rows"] = ws.replayed_rows
        return reply

    def truncate(self, client: bytes, req: m.WsTruncate) -> dict:
        ws = self.sets.idle(client, req.ws)
        if req.n > ws.committed:
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"truncate to {req.n} past committed length {ws.committed}")
        if ws.state is not None and req.n < ws.committed:
            raise PieError(
                ErrorCode.UNSUPPORTED,
                f"model {ws.model} carries recurrent state, which cannot be cut back to an earlier row; "
                "fork the working set before the rows you may drop instead",
            )
        self.models[ws.model].pages.truncate(ws, req.n)  # UNSUPPORTED past a sliding group's window
        return {"committed": ws.committed}

    def evict(self, client: bytes, req: m.WsEvict) -> dict:
        """Drops the rows ``req`` names (kv_pages.evict); they must all be committed rows of an idle working set
        of a model without recurrent state."""
        ws = self.sets.idle(client, req.ws)  # BUSY / FOLD_PENDING: an edit never races a fire
        if ws.state is not None:
            raise PieError(
                ErrorCode.UNSUPPORTED,
                f"model {ws.model} carries recurrent state, which cannot forget a row: evict needs attention layers",
            )
        self.identities.charge_evict(client, len(req.rows) + len(req.ranges))
        last = max([r + 1 for r in req.rows] + [stop for _, stop in req.ranges], default=0)
        if last > ws.committed:  # checked before the set is built: a range may be huge
            raise PieError(
                ErrorCode.ROW_OUT_OF_RANGE,
                f"evict names rows up to {last - 1}, past the {ws.committed} committed rows of working set {ws.id}",
            )
        drop = rows_named(req.rows, req.ranges)
        kv = self.models[ws.model].pages
        freed = kv.evict(ws, drop) if drop else 0
        return {"committed": ws.committed, "dropped": ws.dropped, "pages": kv.held(ws), "freed": freed}

    def release(self, ws: WorkingSet, notify: bool = True) -> None:
        """Returns ``ws``'s pages; its queued fires are dropped (a run-ahead stops) and, with ``notify``,
        answered with an error. Host takes that waited on a dropped fire's channel writes are answered at
        once (with what the channel holds, or ``channel_empty``): no fire will write for them any more."""
        served = self.models[ws.model]
        self.sets.remove(ws)
        self._count(ws.owner, -1)
        dropped = served.queue.drop(ws)
        if notify and dropped:
            err = PieError(ErrorCode.UNKNOWN_WORKING_SET, f"working set {ws.id} was released in flight")
            self.outbox.extend(
                (fire.client, {"id": fire.req_id, "ok": False, "error": err.to_wire()}) for fire in dropped
            )
        served.pages.release(ws)
        if served.states is not None and ws.state is not None:
            served.states.release(ws.state)
        if dropped and self.channels is not None:
            self.outbox.extend(self.channels.serve(self.models.writes))

    def drop_client(self, client: bytes) -> int:
        """Releases every working set of a departed client; returns how many it had."""
        mine = self.sets.owned_by(client)
        for ws in mine:
            self.release(ws, notify=False)
        return len(mine)


def rows_named(rows: list[int], ranges: list[list[int]]) -> set[int]:
    """The rows an evict names. Its ranges are merged first, so thousands of overlapping ranges cost their
    sort and the rows they cover once, not each range's rows again (a stall of the engine's loop)."""
    merged: list[list[int]] = []
    for start, stop in sorted((a, b) for a, b in ranges if b > a):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    drop = set(rows)
    for start, stop in merged:
        drop.update(range(start, stop))
    return drop
