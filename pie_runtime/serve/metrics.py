"""`GET /metrics`: the server's Prometheus page (prometheus-client, one registry per server).

Two sources:
- what the HTTP server sees, kept as it happens: requests running and waiting, prompt and generated tokens,
  and the latency histograms (time to first token, inter-token latency: the gap between two text events of
  a stream, which may carry several tokens under speculation; end-to-end; queue time: from arrival until the
  run is handed to a host), labelled by model and inferlet;
- what only the engine knows, read from its ``stats`` op when the page is scraped: KV pages used and their
  ratio, the KV edits (rows evicted and the pages that gave back, working sets and rows restored from saved K/V),
  the speculation totals the runs reported (``spec_report``) per model and inferlet, and the prefix
  cache's queries and hits. They are exposed as the engine's own running totals (a custom collector), so the
  counters are exactly the engine's. Under ``pie serve --engines N`` every engine's, each with an ``engine``
  label, and the router's counts (``ClusterCounts``): placements by engine and reason, cache-aware hits,
  imbalance-guard fires, refusals, unplaced runs, retries, and each engine's liveness and runs in flight;
- the one engine's life under a single-engine server: up or not, and how many times it was restarted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .engine_life import EngineStatus

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class EngineCollector(Collector):
    """Exposes the last ``stats`` replies of the engines (set by ``update`` right before each scrape), keyed by
    engine name: one engine's under the key ``""`` and without an ``engine`` label, several engines'
    (``pie serve --engines N``) each under its own ``engine`` label."""

    def __init__(self) -> None:
        self.stats: dict[str, dict[str, Any]] = {}

    def update(self, stats: dict[str, dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self):
        by = ["engine"] if any(self.stats) else []
        used = GaugeMetricFamily("pie_kv_pages_used", "KV pages in use", labels=[*by, "model"])
        ratio = GaugeMetricFamily("pie_kv_usage_ratio", "KV pages in use over the pool", labels=[*by, "model"])
        groups = GaugeMetricFamily(
            "pie_kv_group_pages", "KV pages working sets hold per page group", labels=[*by, "model", "group", "window"]
        )
        queries = CounterMetricFamily("pie_prefix_cache_queries", "prefix-cache lookups", labels=[*by, "model"])
        hits = CounterMetricFamily("pie_prefix_cache_hits", "prefix-cache lookups that hit", labels=[*by, "model"])
        stale = GaugeMetricFamily(
            "pie_engine_stats_stale_seconds",
            "age of the engine figures on this page (0: it answered now; else its last answer, kept while a long step "
            "keeps it from answering)",
            labels=by,
        )
        spec = _Speculation(by)
        edits = _KVEdits(by)
        for engine, s in self.stats.items():
            key = [engine] if by else []
            stale.add_metric(key, float(s.get("stale_s", 0.0)))
            models: dict[str, dict] = s.get("models") or {}
            for name, m in models.items():
                total = int(m.get("pages_total", 0))
                in_use = total - int(m.get("pages_free", 0))
                used.add_metric([*key, name], in_use)
                ratio.add_metric([*key, name], in_use / total if total else 0.0)
                cache = m.get("prefix_cache") or (s.get("prefix_cache") if len(models) == 1 else None) or {}
                queries.add_metric([*key, name], float(cache.get("queries", 0)))
                hits.add_metric([*key, name], float(cache.get("hits", 0)))
                edits.add([*key, name], m.get("kv") or {})
                for g, group in enumerate(m.get("page_groups") or []):
                    window = "" if group.get("window") is None else str(group["window"])
                    groups.add_metric([*key, name, str(g), window], float(group.get("pages", 0)))
            spec.add(key, s.get("speculation") or {})
        yield from (used, ratio, groups, queries, hits, stale)
        yield from edits.families()
        yield from spec.families()


class _KVEdits:
    """The KV edits the engine counted (its ``stats``' ``kv``, engine/kv_pages.py ``KVEdits``), per model."""

    NAMES = {  # stats field → (metric, help)
        "evicted_rows": ("pie_kv_evicted_rows", "committed KV rows dropped by evictions (ws_evict)"),
        "evicted_pages": ("pie_kv_evicted_pages", "KV pages evictions gave back to the pool"),
        "restored_working_sets": ("pie_kv_restored_working_sets", "working sets restored from saved K/V"),
        "restored_rows": ("pie_kv_restored_rows", "KV rows restored from saved K/V"),
    }

    def __init__(self, by: list[str]) -> None:
        self.counters = {
            field: CounterMetricFamily(name, text, labels=[*by, "model"]) for field, (name, text) in self.NAMES.items()
        }

    def add(self, key: list[str], kv: dict[str, Any]) -> None:
        for field, counter in self.counters.items():
            counter.add_metric(key, float(kv.get(field, 0)))

    def families(self):
        return tuple(self.counters.values())


class _Speculation:
    """The speculation totals the runs reported (``spec_report``), per model and inferlet (and engine)."""

    def __init__(self, by: list[str]) -> None:
        labels = [*by, "model", "inferlet"]
        self.rounds = CounterMetricFamily("pie_speculative_rounds", "verify rounds", labels=labels)
        self.proposed = CounterMetricFamily("pie_speculative_proposed_tokens", "draft tokens proposed", labels=labels)
        self.accepted = CounterMetricFamily(
            "pie_speculative_accepted_tokens", "draft tokens kept (not tokens returned)", labels=labels
        )
        self.skipped = CounterMetricFamily(
            "pie_speculative_skipped_rows", "plain steps taken instead of a round", labels=[*labels, "reason"]
        )
        self.per_pos = CounterMetricFamily(
            "pie_speculative_accepted_tokens_per_pos",
            "rounds that kept the draft at each position (1-based)",
            labels=[*labels, "position"],
        )
        self.reached_per_pos = CounterMetricFamily(
            "pie_speculative_reached_per_pos",
            "rounds that verified the draft at each position (1-based) with the ones before it kept",
            labels=[*labels, "position"],
        )

    def add(self, engine: list[str], spec: dict[str, dict[str, dict]]) -> None:
        for model, by_inferlet in spec.items():
            for inferlet, t in by_inferlet.items():
                key = [*engine, model, inferlet]
                self.rounds.add_metric(key, float(t.get("rounds", 0)))
                self.proposed.add_metric(key, float(t.get("proposed", 0)))
                self.accepted.add_metric(key, float(t.get("accepted", 0)))
                for reason, n in (t.get("skipped") or {}).items():
                    self.skipped.add_metric([*key, reason], float(n))
                for i, n in enumerate(t.get("accepted_per_position") or []):
                    self.per_pos.add_metric([*key, str(i + 1)], float(n))
                for i, n in enumerate(t.get("reached_per_position") or []):
                    self.reached_per_pos.add_metric([*key, str(i + 1)], float(n))

    def families(self):
        return (self.rounds, self.proposed, self.accepted, self.skipped, self.per_pos, self.reached_per_pos)


@dataclass
class ClusterCounts:
    """What ``pie serve --engines N``'s pool and router did (``cluster/pool.py``), for the page."""

    live: dict[str, bool]  # engine → placeable now
    in_flight: dict[str, int]  # engine → runs on it now
    placements: dict[tuple[str, str], int]  # (engine, reason) → runs placed there for that reason
    refusals: dict[str, int]  # engine → runs it refused (too few free KV pages), the next candidate took them
    unplaced: int  # runs that every live engine refused, or that found none
    retries: int  # runs run again on another engine after theirs was lost


class ClusterCollector(Collector):
    """Exposes the last ``ClusterCounts`` (set by ``update`` right before each scrape)."""

    def __init__(self) -> None:
        self.counts: ClusterCounts | None = None

    def update(self, counts: ClusterCounts | None) -> None:
        self.counts = counts

    def collect(self):
        c = self.counts
        if c is None:
            return
        up = GaugeMetricFamily("pie_engine_up", "1 while the router places runs on the engine", labels=["engine"])
        flight = GaugeMetricFamily("pie_engine_runs_in_flight", "runs placed on the engine now", labels=["engine"])
        placed = CounterMetricFamily(
            "pie_router_placements",
            "runs placed, by engine and reason (cache: a cache-aware hit; balance: the imbalance guard)",
            labels=["engine", "reason"],
        )
        hits = CounterMetricFamily("pie_router_cache_hits", "runs placed by a prefix match", labels=["engine"])
        guard = CounterMetricFamily("pie_router_balance_fires", "runs the imbalance guard placed", labels=["engine"])
        refused = CounterMetricFamily("pie_router_refusals", "runs an engine refused (no pages)", labels=["engine"])
        for engine in sorted(c.live):
            up.add_metric([engine], 1.0 if c.live[engine] else 0.0)
            flight.add_metric([engine], float(c.in_flight.get(engine, 0)))
            hits.add_metric([engine], float(c.placements.get((engine, "cache"), 0)))
            guard.add_metric([engine], float(c.placements.get((engine, "balance"), 0)))
            refused.add_metric([engine], float(c.refusals.get(engine, 0)))
        for (engine, reason), n in sorted(c.placements.items()):
            placed.add_metric([engine, reason], float(n))
        unplaced = CounterMetricFamily("pie_router_unplaced", "runs no live engine would take")
        unplaced.add_metric([], float(c.unplaced))
        retries = CounterMetricFamily("pie_router_retries", "runs run again after their engine was lost")
        retries.add_metric([], float(c.retries))
        yield from (up, flight, placed, hits, guard, refused, unplaced, retries)


class EngineLifeCollector(Collector):
    """The one engine's life (``engine_life.EngineStatus``, set right before each scrape): ``pie_engine_up``
    (1 while an engine serves) and ``pie_engine_restarts_total``. Nothing under --engines N, whose engines'
    liveness is the ClusterCollector's ``pie_engine_up{engine}``."""

    def __init__(self) -> None:
        self.status: EngineStatus | None = None

    def update(self, status: EngineStatus | None) -> None:
        self.status = status

    def collect(self):
        if self.status is None:
            return
        up = GaugeMetricFamily("pie_engine_up", "1 while the engine process serves")
        up.add_metric([], 1.0 if self.status.state == "up" else 0.0)
        restarts = CounterMetricFamily("pie_engine_restarts", "engines started again after one died")
        restarts.add_metric([], float(self.status.restarts))
        yield from (up, restarts)


class Metrics:
    """The server's metrics; ``render()`` is the page."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, mi = self.registry, ["model", "inferlet"]
        self.running = Gauge("pie_requests_running", "requests whose run is in a host", ["model"], registry=r)
        self.waiting = Gauge(
            "pie_requests_waiting",
            "requests admitted, waiting for a run slot or room in the KV pool",
            ["model"],
            registry=r,
        )
        self.kv_admitted = Gauge(
            "pie_kv_admitted_pages",
            "KV pages the running requests can grow to (the server's KV admission)",
            ["model"],
            registry=r,
        )
        self.most_running = Gauge(
            "pie_requests_running_max", "the most requests that held room in the KV pool at once", ["model"], registry=r
        )
        self.prompt_tokens = Counter("pie_prompt_tokens", "prompt tokens of finished requests", mi, registry=r)
        self.generation_tokens = Counter("pie_generation_tokens", "tokens generated", mi, registry=r)
        self.requests = Counter("pie_requests", "finished requests by outcome", [*mi, "outcome"], registry=r)
        self.ttft = Histogram(
            "pie_time_to_first_token_seconds", "arrival to first text", mi, buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "pie_inter_token_latency_seconds", "gap between text events", mi, buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "pie_e2e_request_latency_seconds", "arrival to the result", mi, buckets=E2E_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "pie_request_queue_time_seconds", "arrival to the run's start", mi, buckets=E2E_BUCKETS, registry=r
        )
        self.engine = EngineCollector()
        r.register(self.engine)
        self.cluster = ClusterCollector()
        r.register(self.cluster)
        self.life = EngineLifeCollector()
        r.register(self.life)

    def render(
        self,
        engine_stats: dict[str, dict[str, Any]] | None,
        cluster: ClusterCounts | None = None,
        life: EngineStatus | None = None,
    ) -> bytes:
        """The page; ``engine_stats``: engine name (``""`` for the one engine) → its ``stats`` reply, None to
        show the last ones again; ``life``: the one engine's state and restarts (None under --engines N)."""
        if engine_stats is not None:
            self.engine.update(engine_stats)
        self.cluster.update(cluster)
        self.life.update(life)
        return generate_latest(self.registry)
