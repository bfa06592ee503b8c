"""The working-set requests: ``ws_open``, ``ws_fork``, ``ws_release``, ``ws_fold``, ``ws_truncate``, and the
release of a departed client's working sets. Each checks everything before it changes anything."""

from __future__ import annotations

from ..protocol import ErrorCode, PieError
from ..protocol import messages as m
from .jobs import Handler, Reply
from .served import ServedModels
from .working_set import WorkingSet, WorkingSetTable


class WorkingSetRequests:
    def __init__(self, models: ServedModels, sets: WorkingSetTable, outbox: list[Reply]):
        self.models = models
        self.sets = sets
        self.outbox = outbox  # replies owed to the fires a release drops

    def ops(self) -> dict[str, Handler]:
        return {
            "ws_open": self.open,
            "ws_fork": self.fork,
            "ws_release": self.release_request,
            "ws_fold": self.fold,
            "ws_truncate": self.truncate,
        }

    def open(self, client: bytes, req: m.WsOpen) -> dict:
        sm = self.models.get(req.model)
        ws = self.sets.open(client, sm.name)
        return {"ws": ws.id, "model": sm.name, "committed": 0}

    def fork(self, client: bytes, req: m.WsFork) -> dict:
        parent = self.sets.idle(client, req.ws)
        pages = self.models[parent.model].pages.fork(parent)
        child = self.sets.open(client, parent.model, pages=pages, committed=parent.committed)
        return {"ws": child.id, "committed": child.committed}

    def release_request(self, client: bytes, req: m.WsRelease) -> dict:
        self.release(self.sets.get(client, req.ws))
        return {}

    def fold(self, client: bytes, req: m.WsFold) -> dict:
        ws = self.sets.get(client, req.ws)
        ws.check_settle(req.n)
        ws.committed += req.n
        ws.pending_fold = None
        self.models[ws.model].pages.trim(ws)
        return {"committed": ws.committed}

    def truncate(self, client: bytes, req: m.WsTruncate) -> dict:
        ws = self.sets.idle(client, req.ws)
        if req.n > ws.committed:
            raise PieError(ErrorCode.INVALID_ARGUMENT, f"truncate to {req.n} past committed length {ws.committed}")
        ws.committed = req.n
        self.models[ws.model].pages.trim(ws)
        return {"committed": ws.committed}

    def release(self, ws: WorkingSet, notify: bool = True) -> None:
        """Returns ``ws``'s pages; its queued fires are dropped (a run-ahead stops) and, with ``notify``,
        answered with an error."""
        sm = self.models[ws.model]
        self.sets.remove(ws)
        dropped = sm.queue.drop(ws)
        if notify and dropped:
            err = PieError(ErrorCode.UNKNOWN_WORKING_SET, f"working set {ws.id} was released in flight")
            self.outbox.extend((j.client, {"id": j.req_id, "ok": False, "error": err.to_wire()}) for j in dropped)
        sm.pages.release(ws)

    def drop_client(self, client: bytes) -> int:
        """Releases every working set of a departed client; returns how many it had."""
        mine = self.sets.owned_by(client)
        for ws in mine:
            self.release(ws, notify=False)
        return len(mine)
