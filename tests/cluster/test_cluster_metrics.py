"""`GET /metrics` of a real `pie serve --engines 2` (tiny model, a local Ray): every engine's gauges and
counters under its ``engine`` label, and the router's counts: placements by engine and reason (a repeated
prompt is a cache-aware hit on the engine that has it), guard fires, refusals, unplaced runs, retries."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TINY
from tests.serve.server_proc import start_serve

pytest.importorskip("ray")

pytestmark = pytest.mark.e2e

ENGINES = {"engine-0", "engine-1"}
PROMPTS = [  # distinct from their first tokens, several KV pages each
    f"{name} here. You are a careful assistant for a library in a small town. Answer questions about opening "
    "hours, loans, late fees and the reading club, politely and briefly."
    for name in ("Ada", "Brook")
]


@pytest.fixture(scope="module")
def server(pie_home):
    s = start_serve(
        pie_home,
        TINY,
        *["--engines", "2", "--engine-cpus", "0.5", "--kv-pages", "256", "--pass-cost-rows", "0"],
        *["--weights", "fp32", "--no-compile", "--threads", "1"],
    )
    yield s
    assert s.stop() == 0


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) → value."""
    page = httpx.get(f"{server.base}/metrics", timeout=60).text
    out = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def by_engine(samples: dict, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in samples.items():
        if n == name:
            engine = dict(labels)["engine"]
            out[engine] = out.get(engine, 0.0) + v
    return out


def complete(server, prompt: str) -> None:
    body = {"model": TINY, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text


def test_every_engine_and_the_router_on_one_page(server):
    for prompt in [*PROMPTS, PROMPTS[0], PROMPTS[0]]:  # two new prefixes spread, then two cache-aware hits
        complete(server, prompt)
    samples = scrape(server)

    for name in ("pie_kv_pages_used", "pie_kv_usage_ratio", "pie_prefix_cache_queries_total"):
        assert set(by_engine(samples, name)) == ENGINES, name  # each engine's own, under its label
    assert all(v > 0 for v in by_engine(samples, "pie_prefix_cache_queries_total").values())  # both served runs
    assert by_engine(samples, "pie_engine_up") == {"engine-0": 1.0, "engine-1": 1.0}
    assert by_engine(samples, "pie_engine_runs_in_flight") == {"engine-0": 0.0, "engine-1": 0.0}

    placed = {
        (dict(ls)["engine"], dict(ls)["reason"]): v
        for (n, ls), v in samples.items()
        if n == "pie_router_placements_total"
    }
    assert sum(placed.values()) == 4
    assert {e for e, _ in placed} == ENGINES  # spread
    hits = by_engine(samples, "pie_router_cache_hits_total")
    assert sum(hits.values()) == 2 and hits == {e: placed.get((e, "cache"), 0.0) for e in ENGINES}
    assert by_engine(samples, "pie_router_balance_fires_total") == {"engine-0": 0.0, "engine-1": 0.0}
    assert by_engine(samples, "pie_router_refusals_total") == {"engine-0": 0.0, "engine-1": 0.0}
    assert samples[("pie_router_retries_total", frozenset())] == 0
    assert samples[("pie_router_unplaced_total", frozenset())] == 0
    assert samples[("pie_requests_running", frozenset({("model", TINY)}))] == 0  # the server's own, unchanged
