"""The engine core: the parts an engine is made of, and the request each op goes to.

    models      ServedModels: per model, its runner, KV pages (kv_pages.py, with its prefix cache unless
                ``prefix_cache=False`` or the model carries recurrent state: prefix_cache.py), its state
                slots (state_slots.py) and fire queue (served.py)
    sets        WorkingSetTable: every client's working sets (working_set.py)
    channels    ChannelTable: device channels and the host takes waiting on them (channels.py)
    requests    working sets (ws_requests.py), fires (fire_requests.py), programs and channels
                (programs/requests.py), and the engine's own: hello, ping, tokenizer, stats, spec_report
    _step       Step: schedule → execute → commit over the queued fires (step.py)

The server (server.py) hands every parsed request to :meth:`EngineCore.handle` and runs :meth:`step` while
there is work; a request is answered at once, except a fire, answered by the step that finishes it.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..protocol import ErrorCode, PieError
from ..protocol import messages as m
from ..protocol.programs import PROGRAM_MEMORY
from .channels import ChannelTable
from .fire_requests import FireRequests
from .identities import Identities, Identity
from .jobs import Handler, Reply, StepStats
from .kv_transfer import KVTransferRequests
from .programs.registry import MAX_PROGRAMS
from .programs.requests import ProgramRequests
from .served import ServedModel, ServedModels
from .spec_totals import SpecTotals, totals_for
from .step import Step
from .working_set import WorkingSetTable
from .ws_requests import WorkingSetRequests


class EngineCore:
    def __init__(
        self,
        models: list[ServedModel],
        max_batch_tokens: int = 256,
        program_memory: int = PROGRAM_MEMORY,
        prefix_cache: bool = True,
        max_programs: int = MAX_PROGRAMS,
    ):
        """``prefix_cache``: name full committed KV pages and let new working sets reuse them (prefix_cache.py).
        ``max_programs``: the programs one client identity holds at once, least recently used evicted
        (programs/registry.py)."""
        self.models = ServedModels(models)
        self.sets = WorkingSetTable()
        self.identities = Identities()  # whose totals a client's requests are charged to (identities.py)
        self.channels = ChannelTable(self.identities)
        self.stats = StepStats()
        self.outbox: list[Reply] = []  # replies owed outside the request being handled (waiting takes)
        self.spec_totals: dict[str, dict[str, SpecTotals]] = {}  # model → inferlet → summed run counters
        self.working_sets = WorkingSetRequests(self.models, self.sets, self.outbox, self.channels, self.identities)
        self.programs = ProgramRequests(self.models, self.channels, self.outbox, program_memory, max_programs)
        self.fires = FireRequests(self.models, self.sets, self.programs)
        self._step = Step(self.models, self.channels, self.stats, max_batch_tokens)
        own: dict[str, Handler] = {
            "ping": self._ping,
            "hello": self._hello,
            "tokenizer": self._tokenizer,
            "stats": self._stats,
            "spec_report": self._spec_report,
        }
        kv = KVTransferRequests(self.models, self.sets)
        self.ops: dict[str, Handler] = {
            **own,
            **self.working_sets.ops(),
            **kv.ops(),
            **self.fires.ops(),
            **self.programs.ops(),
        }
        for served in self.models:
            served.pages.chunk_rows = max_batch_tokens  # a moving fire's sliding pages span a window and a chunk
            served.info.chunk_rows = max_batch_tokens
            # a recurrent state is not addressable by page; a sliding page group's hit would need the prefix's last
            # window of rows, which the cache does not name (engine/kv_pages.py)
            if prefix_cache and not served.info.recurrent and served.pages.windows == (None,):
                served.pages.enable_prefix_cache(served.name)
            if not served.info.hidden_size:
                served.info.hidden_size = served.runner.model.config.hidden_size

    def handle(self, client: bytes, req: Any) -> dict | None:
        """Applies one request. Returns the reply, or None when the reply comes after a step (fires)."""
        return self.ops[req.op](client, req)

    def has_work(self) -> bool:
        return self._step.has_work()

    def identify(self, client: bytes, identity: Identity | None) -> None:
        """Charges ``client``'s requests to ``identity`` (None: the client is its own; identities.py)."""
        self.identities.set(client, identity)

    def new_round(self) -> None:
        """The server's loop went round: per-round totals (evict spans) start again."""
        self.identities.new_round()

    def step(self) -> list[Reply]:
        """One engine step; its replies, and any others owed."""
        return self._step() + self.drain_outbox()

    def drop_client(self, client: bytes) -> int:
        """Releases everything a departed client held (its run-aheads stop with their working sets).
        Returns how many working sets it had."""
        released = self.working_sets.drop_client(client)
        self.programs.drop_client(client)
        self.outbox[:] = [r for r in self.outbox if r[0] != client]
        self.identities.forget(client)  # last: the releases above are counted against its identity
        return released

    def drain_outbox(self) -> list[Reply]:
        out = list(self.outbox)
        self.outbox.clear()
        return out

    # ---- the engine's own requests ----------------------------------------------------------------

    def _ping(self, client: bytes, req: m.Ping) -> dict:
        return {}

    def _hello(self, client: bytes, req: m.Hello) -> dict:
        if req.version != m.PROTOCOL_VERSION:
            raise PieError(
                ErrorCode.VERSION_MISMATCH, f"client speaks protocol {req.version}, engine {m.PROTOCOL_VERSION}"
            )
        return {
            "version": m.PROTOCOL_VERSION,
            "default_model": self.models.default,
            "models": [served.info.model_dump() for served in self.models],
        }

    def _tokenizer(self, client: bytes, req: m.GetTokenizer) -> dict:
        return {"tokenizer_json": self.models.get(req.model).tokenizer_json}

    def _spec_report(self, client: bytes, req: m.SpecReport) -> dict:
        served = self.models.get(req.model)
        totals_for(self.spec_totals.setdefault(served.name, {}), req.inferlet).add(req)
        return {}

    def _stats(self, client: bytes, req: m.Stats) -> dict:
        s = self.stats
        return {
            "steps": s.steps,
            "rows": s.rows,
            "fires": s.fires,
            "forward_s": s.forward_s,
            "epilogue_s": s.epilogue_s,
            "step_s": s.step_s,
            "working_sets": len(self.sets),
            "channels": len(self.channels.channels),
            "programs": self.programs.count(),
            "program_evictions": self.programs.programs.evictions,  # past --max-programs (programs/registry.py)
            "run_ahead": sum(fire.run is not None for fire in self.models.jobs()),
            "models": {
                served.name: {
                    "pages_total": served.pages.total,
                    "pages_free": served.pages.free,
                    "queued": len(served.queue),
                    "prefix_cache": self._prefix_stats(served).model_dump(),
                    "kv": self._kv_stats([served]).model_dump(),
                    "page_bytes": served.info.page_bytes,
                    "page_groups": self._page_groups(served),
                    "state_slots": {
                        "used": served.states.used if served.states is not None else 0,
                        "total": served.states.total if served.states is not None else 0,
                    },
                }
                for served in self.models
            },
            "prefix_cache": self._prefix_totals().model_dump(),
            "kv": self._kv_stats(list(self.models)).model_dump(),
            "speculation": {
                name: {inferlet: t.as_dict() for inferlet, t in by_inferlet.items()}
                for name, by_inferlet in self.spec_totals.items()
            },
        }

    def _page_groups(self, served: ServedModel) -> list[dict]:
        """Pages the working sets of ``served`` hold, per page group (models/kv_groups.py), with its window."""
        held = [0] * len(served.pages.windows)
        for ws in self.sets.all():
            if ws.model == served.name:
                for g, n in enumerate(served.pages.held_per_group(ws)):
                    held[g] += n
        return [{"window": w, "pages": n} for w, n in zip(served.pages.windows, held)]

    @staticmethod
    def _kv_stats(models: list[ServedModel]) -> m.KVStats:
        """The KV pools of ``models``, summed: pages and the edit totals (kv_pages.KVEdits)."""
        edits = [asdict(served.pages.edits) for served in models]
        return m.KVStats(
            pages_used=sum(served.pages.used for served in models),
            pages_total=sum(served.pages.total for served in models),
            **{f: sum(e[f] for e in edits) for f in edits[0]} if edits else {},
        )

    @staticmethod
    def _prefix_stats(served: ServedModel) -> m.PrefixCacheStats:
        cache = served.pages.cache
        if cache is None:
            return m.PrefixCacheStats(enabled=False)
        s = cache.stats
        return m.PrefixCacheStats(
            enabled=True,
            queries=s.queries,
            hits=s.hits,
            query_tokens=s.query_tokens,
            hit_tokens=s.hit_tokens,
            cached_pages=cache.cached_pages,
            evictions=served.pages.pool.evictions,
        )

    def _prefix_totals(self) -> m.PrefixCacheStats:
        """The prefix caches of every served model, summed."""
        per_model = [self._prefix_stats(served) for served in self.models]
        fields = [f for f in m.PrefixCacheStats.model_fields if f != "enabled"]
        sums = {f: sum(getattr(s, f) for s in per_model) for f in fields}
        return m.PrefixCacheStats(enabled=any(s.enabled for s in per_model), **sums)
