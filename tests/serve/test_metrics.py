"""`GET /metrics` of a real `pie serve` (tiny model, ``--draft-lookup``), parsed with prometheus-client's own
text parser: every metric the issue names is there, and the counters move exactly as the requests sent
imply (tokens from the responses' usage, speculation totals from the responses' speculation objects, one
histogram observation per request); the Grafana dashboard in docs/grafana queries only what is exported."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TINY
from tests.serve.server_proc import start_serve

pytestmark = pytest.mark.e2e

LOOKUP = "cacheback-speculative-decoding"
PLAIN = "text-completion"
NAMES = [
    "pie_speculative_rounds_total",
    "pie_speculative_proposed_tokens_total",
    "pie_speculative_accepted_tokens_total",
    "pie_speculative_skipped_rows_total",
    "pie_speculative_accepted_tokens_per_pos_total",
    "pie_speculative_reached_per_pos_total",
    "pie_requests_running",
    "pie_requests_waiting",
    "pie_kv_pages_used",
    "pie_kv_usage_ratio",
    "pie_prompt_tokens_total",
    "pie_generation_tokens_total",
    "pie_prefix_cache_queries_total",
    "pie_prefix_cache_hits_total",
    "pie_time_to_first_token_seconds_count",
    "pie_inter_token_latency_seconds_count",
    "pie_e2e_request_latency_seconds_count",
    "pie_request_queue_time_seconds_count",
]
DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "pie-serve.json"
PROMPT = "one two three four one two three four one two three four one two three"


@pytest.fixture(scope="module")
def server(pie_home):
    s = start_serve(pie_home, TINY, "--kv-pages", "256", "--pass-cost-rows", "0", "--draft-lookup", "2:4")
    yield s
    s.stop()


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) → value."""
    page = httpx.get(f"{server.base}/metrics").text
    out = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def complete(server, **kw) -> dict:
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **kw}
    r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_metric_is_exposed(server):
    complete(server)  # a run of each kind, so the per-inferlet series exist
    complete(server, speculation=False)
    names = {n for n, _ in scrape(server)}
    missing = [n for n in NAMES if n not in names and n != "pie_speculative_skipped_rows_total"]
    assert missing == []
    assert total(scrape(server), "pie_kv_usage_ratio", model=TINY) >= 0


def test_counters_move_as_the_requests_imply(server):
    before = scrape(server)
    spec = [complete(server, max_tokens=m) for m in (8, 12, 16)]
    plain = [complete(server, speculation=False, max_tokens=m) for m in (5, 7)]
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, model=TINY, **labels) - total(before, name, model=TINY, **labels)

    for runs, inferlet in ((spec, LOOKUP), (plain, PLAIN)):
        usage = [r["usage"] for r in runs]
        assert delta("pie_prompt_tokens_total", inferlet=inferlet) == sum(u["prompt_tokens"] for u in usage)
        assert delta("pie_generation_tokens_total", inferlet=inferlet) == sum(u["completion_tokens"] for u in usage)
        for hist in ("pie_time_to_first_token_seconds", "pie_e2e_request_latency_seconds"):
            assert delta(f"{hist}_count", inferlet=inferlet) == len(runs)
        assert delta("pie_request_queue_time_seconds_count", inferlet=inferlet) == len(runs)
    # the engine's speculation totals: exactly what the runs reported
    reports = [r["speculation"] for r in spec]
    assert all("speculation" not in r for r in plain)
    assert delta("pie_speculative_rounds_total", inferlet=LOOKUP) == sum(s["rounds"] for s in reports)
    assert delta("pie_speculative_proposed_tokens_total", inferlet=LOOKUP) == sum(s["proposed"] for s in reports)
    assert delta("pie_speculative_accepted_tokens_total", inferlet=LOOKUP) == sum(s["accepted"] for s in reports)
    assert sum(s["proposed"] for s in reports) > 0  # the repeating prompt gives lookup drafts
    per_pos = delta("pie_speculative_accepted_tokens_per_pos_total", inferlet=LOOKUP)
    assert per_pos == delta("pie_speculative_accepted_tokens_total", inferlet=LOOKUP)
    reached = delta("pie_speculative_reached_per_pos_total", inferlet=LOOKUP)
    assert reached == sum(sum(s["reached_per_position"]) for s in reports) >= per_pos
    assert delta("pie_speculative_rounds_total", inferlet=PLAIN) == 0
    # ITL: one gap fewer than the text events of each run, so fewer observations than tokens
    assert (
        0 < delta("pie_inter_token_latency_seconds_count") < sum(r["usage"]["completion_tokens"] for r in spec + plain)
    )
    assert total(after, "pie_requests_running", model=TINY) == 0


def test_prefix_cache_counters_follow_the_engine(server):
    before = scrape(server)
    complete(server, prompt="shared " * 64, max_tokens=2, speculation=False)
    complete(server, prompt="shared " * 64, max_tokens=2, speculation=False)
    after = scrape(server)
    queries = total(after, "pie_prefix_cache_queries_total") - total(before, "pie_prefix_cache_queries_total")
    hits = total(after, "pie_prefix_cache_hits_total") - total(before, "pie_prefix_cache_hits_total")
    assert queries >= 2 and 1 <= hits <= queries


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


def test_grafana_dashboard_queries_only_exported_metrics(server):
    """docs/grafana/pie-serve.json: every PromQL expression names only series this server's /metrics exports
    (a histogram_quantile reads ``_bucket``), and the panels the issue asks for are there."""
    complete(server)  # a lookup run: the speculation series exist
    complete(server, speculation=False)
    exported = {n for n, _ in scrape(server)}
    exprs = dashboard_exprs()
    used = {name for e in exprs for name in re.findall(r"\bpie_[a-z0-9_]+", e)}
    assert used - exported == set()
    for e in exprs:
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}")
        for inner in re.findall(r"histogram_quantile\(([^,]+),", e):
            assert 0 < float(inner) < 1
        assert all(n.endswith("_bucket") for n in re.findall(r"rate\((pie_\w+_seconds\w*)", e))
    for wanted in (
        "pie_generation_tokens_total",
        "pie_time_to_first_token_seconds_bucket",
        "pie_inter_token_latency_seconds_bucket",
        "pie_speculative_accepted_tokens_per_pos_total",
        "pie_kv_pages_used",
        "pie_requests_waiting",
    ):
        assert wanted in used
