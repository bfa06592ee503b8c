"""`GET /metrics`: the server's Prometheus page (prometheus-client, one registry per server).

Two sources:
- what the HTTP server sees, kept as it happens: requests running and waiting, prompt and generated tokens,
  and the latency histograms (time to first token, inter-token latency: the gap between two text events of
  a stream, which may carry several tokens under speculation; end-to-end; queue time: from arrival until the
  run is handed to a host), labelled by model and inferlet;
- what only the engine knows, read from its ``stats`` op when the page is scraped: KV pages used and their
  ratio, the speculation totals the runs reported (``spec_report``) per model and inferlet, and the prefix
  cache's queries and hits. They are exposed as the engine's own running totals (a custom collector), so the
  counters are exactly the engine's.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class EngineCollector(Collector):
    """Exposes the last ``stats`` reply of the engine (set by ``update`` right before each scrape)."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def update(self, stats: dict[str, Any]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats
        models: dict[str, dict] = s.get("models") or {}
        used = GaugeMetricFamily("pie_kv_pages_used", "KV pages in use", labels=["model"])
        ratio = GaugeMetricFamily("pie_kv_usage_ratio", "KV pages in use over the pool", labels=["model"])
        queries = CounterMetricFamily("pie_prefix_cache_queries", "prefix-cache lookups", labels=["model"])
        hits = CounterMetricFamily("pie_prefix_cache_hits", "prefix-cache lookups that hit", labels=["model"])
        for name, m in models.items():
            total = int(m.get("pages_total", 0))
            in_use = total - int(m.get("pages_free", 0))
            used.add_metric([name], in_use)
            ratio.add_metric([name], in_use / total if total else 0.0)
            cache = m.get("prefix_cache") or (s.get("prefix_cache") if len(models) == 1 else None) or {}
            queries.add_metric([name], float(cache.get("queries", 0)))
            hits.add_metric([name], float(cache.get("hits", 0)))
        yield from (used, ratio, queries, hits)
        yield from self._speculation(s.get("speculation") or {})

    @staticmethod
    def _speculation(spec: dict[str, dict[str, dict]]):
        labels = ["model", "inferlet"]
        rounds = CounterMetricFamily("pie_speculative_rounds", "verify rounds", labels=labels)
        proposed = CounterMetricFamily("pie_speculative_proposed_tokens", "draft tokens proposed", labels=labels)
        accepted = CounterMetricFamily(
            "pie_speculative_accepted_tokens", "draft tokens kept (not tokens returned)", labels=labels
        )
        skipped = CounterMetricFamily(
            "pie_speculative_skipped_rows", "plain steps taken instead of a round", labels=[*labels, "reason"]
        )
        per_pos = CounterMetricFamily(
            "pie_speculative_accepted_tokens_per_pos",
            "rounds that kept the draft at each position (1-based)",
            labels=[*labels, "position"],
        )
        for model, by_inferlet in spec.items():
            for inferlet, t in by_inferlet.items():
                key = [model, inferlet]
                rounds.add_metric(key, float(t.get("rounds", 0)))
                proposed.add_metric(key, float(t.get("proposed", 0)))
                accepted.add_metric(key, float(t.get("accepted", 0)))
                for reason, n in (t.get("skipped") or {}).items():
                    skipped.add_metric([*key, reason], float(n))
                for i, n in enumerate(t.get("accepted_per_position") or []):
                    per_pos.add_metric([*key, str(i + 1)], float(n))
        yield from (rounds, proposed, accepted, skipped, per_pos)


class Metrics:
    """The server's metrics; ``render()`` is the page."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, mi = self.registry, ["model", "inferlet"]
        self.running = Gauge("pie_requests_running", "requests whose run is in a host", ["model"], registry=r)
        self.waiting = Gauge("pie_requests_waiting", "requests admitted, waiting for a run slot", ["model"], registry=r)
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

    def render(self, engine_stats: dict[str, Any] | None) -> bytes:
        if engine_stats is not None:
            self.engine.update(engine_stats)
        return generate_latest(self.registry)
