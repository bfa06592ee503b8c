"""API keys and per-key quotas on a real `pie serve` (tiny model): 401 without a valid key, 429 over a key's
concurrency, KV-page, KV-bytes or tokens-per-minute quota, and a key at its page quota does not starve another key;
503 when every run slot is taken and nothing may wait. Also the quota arithmetic on its own."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from pie_runtime.serve.auth import KeyQuota, KVNeed, KVShape, Quotas, kv_needed, load_keys, parse_bytes
from pie_runtime.serve.errors import APIError
from tests.conftest import TINY
from tests.serve.server_proc import start_serve

PAGE = 16
LONG = 200  # tokens of the request that holds its key's pages while the others are sent
HOLD_PAGES = kv_needed(8, LONG, 1, KVShape(PAGE)).pages  # one long request (a prompt of a few tokens) fits, no more


@pytest.fixture(scope="module")
def server(pie_home, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    quotas = {
        "alpha": {"concurrent": 4, "kv_pages": HOLD_PAGES},
        "beta": {},
        "gamma": {"tokens_per_minute": 40},
        "delta": {"concurrent": 1},
        "epsilon": {"kv_bytes": "1KiB"},  # less than one page of the tiny model's KV
    }
    keys.write_text(json.dumps({"keys": quotas}))
    s = start_serve(
        pie_home,
        TINY,
        "--kv-pages",
        "1024",
        "--pass-cost-rows",
        "0",
        "--keys",
        str(keys),
        "--max-running",
        "2",
        "--max-waiting",
        "0",
        "--max-tokens",
        "2000",
    )
    yield s
    s.stop()


def post(server, key: str | None, body: dict) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base}/v1/completions", json=body, headers=headers, timeout=300)


def small(**kw) -> dict:
    return {"model": TINY, "prompt": "Hi there", "max_tokens": 4, "temperature": 0, **kw}


def test_v1_needs_a_valid_key(server):
    for key in (None, "wrong"):
        r = post(server, key, small())
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.base}/v1/models").status_code == 401
    assert httpx.get(f"{server.base}/health").status_code == 200  # not under /v1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=f"{server.base}/v1", api_key="beta", max_retries=0)
    assert ok.completions.create(**small()).choices[0].text is not None


def test_uploads_are_off_by_default(server):
    body = {"name": "mine", "source": "x = 1"}
    r = httpx.post(f"{server.base}/v1/inferlets", json=body, headers={"authorization": "Bearer beta"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "upload_disabled"


def test_kv_bytes(server):
    r = post(server, "epsilon", small())
    assert r.status_code == 429 and r.json()["error"]["param"] == "kv_bytes"
    assert "bytes of KV" in r.json()["error"]["message"] and "quota 1024" in r.json()["error"]["message"]


def test_tokens_per_minute(server):
    first = post(server, "gamma", small(max_tokens=30, ignore_eos=True))
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["total_tokens"] <= 40
    second = post(server, "gamma", small(max_tokens=30))
    assert second.status_code == 429
    assert second.json()["error"]["param"] == "tokens_per_minute"


class Holder(threading.Thread):
    """A long streaming request of ``key`` that has produced its first chunk once ``started`` is set."""

    def __init__(self, server, key: str) -> None:
        super().__init__(daemon=True)
        self.server, self.key = server, key
        self.started = threading.Event()
        self.finish: str | None = None
        self.status = 0

    def run(self) -> None:
        body = small(prompt="Hold", max_tokens=LONG, ignore_eos=True, stream=True)
        headers = {"authorization": f"Bearer {self.key}"}
        try:
            with httpx.stream(
                "POST", f"{self.server.base}/v1/completions", json=body, headers=headers, timeout=600
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    self.started.set()
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        for c in chunk.get("choices", []):
                            self.finish = c.get("finish_reason") or self.finish
        finally:
            self.started.set()


def test_a_key_at_its_page_quota_does_not_starve_another(server):
    hold = Holder(server, "alpha")
    hold.start()
    assert hold.started.wait(300) and hold.status == 200
    # alpha holds its page quota: its next request is refused (it would be under its concurrency quota) ...
    again = post(server, "alpha", small(max_tokens=64))
    assert again.status_code == 429 and again.json()["error"]["param"] == "kv_pages"
    # ... while beta is served, and with both run slots taken a third request gets 503 (nothing may wait)
    beta = Holder(server, "beta")
    beta.start()
    assert beta.started.wait(300) and beta.status == 200
    busy = post(server, "delta", small())
    assert busy.status_code == 503 and busy.json()["error"]["code"] == "overloaded"
    hold.join(600)
    beta.join(600)
    assert hold.finish == "length" and beta.finish == "length"
    assert post(server, "alpha", small()).status_code == 200  # its pages are back


def test_quota_arithmetic():
    q = Quotas({"k": KeyQuota(concurrent=2, kv_pages=10, kv_bytes=1000, tokens_per_minute=100)})
    assert q.authenticate("Bearer k") == "k"
    with pytest.raises(APIError) as e:
        q.authenticate("Bearer nope")
    assert e.value.status == 401
    a = q.admit("k", prompt_tokens=10, kv=KVNeed(6, 600))
    with pytest.raises(APIError) as e:
        q.admit("k", prompt_tokens=10, kv=KVNeed(5, 0))
    assert e.value.status == 429 and e.value.param == "kv_pages"
    with pytest.raises(APIError) as e:
        q.admit("k", prompt_tokens=10, kv=KVNeed(1, 401))
    assert e.value.status == 429 and e.value.param == "kv_bytes"
    with pytest.raises(APIError) as e:  # its token budget does not fit the minute's quota
        q.admit("k", prompt_tokens=10, kv=KVNeed(), max_new_tokens=81)
    assert e.value.param == "tokens_per_minute"
    b = q.admit("k", prompt_tokens=10, kv=KVNeed(4, 400), max_new_tokens=10)
    with pytest.raises(APIError) as e:
        q.admit("k", prompt_tokens=1, kv=KVNeed())
    assert e.value.param == "concurrent"
    a.charge(75)
    a.release()
    b.release()
    with pytest.raises(APIError) as e:  # 10 + 10 + 75 charged this minute
        q.admit("k", prompt_tokens=10, kv=KVNeed())
    assert e.value.param == "tokens_per_minute"
    assert q.usage["k"].running == 0 and q.usage["k"].pages == 0 and q.usage["k"].bytes == 0
    one = KVShape(page_size=16, page_bytes=100)
    assert kv_needed(prompt_tokens=20, max_tokens=12, n=1, kv=one) == KVNeed(2, 200)
    assert kv_needed(prompt_tokens=20, max_tokens=12, n=3, kv=one) == KVNeed(2 + 2 * 2, 600)


def test_a_sliding_window_run_is_charged_its_window_not_every_row():
    """Gemma 3 270M's layout (pages of 3 layers: one global group, five sliding with window 512): a 4,000-token
    run is charged the global group's every row and each sliding group's window span only."""
    gemma = KVShape(page_size=16, page_bytes=3 * 2 * 256 * 16 * 4, windows=(None,) + (512,) * 5, chunk_rows=256)
    every = KVShape(16, gemma.page_bytes, (None,) * 6, 256)  # --kv-swa-full: every layer keeps every row
    need, full = kv_needed(3_900, 100, 1, gemma), kv_needed(3_900, 100, 1, every)
    span = -(-(512 + 256 + 3 * 16) // 16) + 1  # kv_groups.window_span in pages, and a page of slack
    assert need.pages == 250 + 5 * span and full.pages == 6 * 250
    assert need.bytes == need.pages * gemma.page_bytes and need.bytes < 0.4 * full.bytes
    short = kv_needed(100, 100, 1, gemma)  # within the window: every row in every group
    assert short == kv_needed(100, 100, 1, every)
    forks = kv_needed(3_900, 2_000, 3, gemma)  # each fork's sliding groups are bounded too
    assert forks.pages == 369 + 5 * span + 2 * (126 + 5 * span)


def test_sizes_parse_with_units(tmp_path):
    assert parse_bytes("64MiB") == 64 << 20 and parse_bytes("1.5GiB") == 3 << 29 and parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("2048") == 2048 << 20 and parse_bytes("4096B") == 4096
    for bad in ("", "12 parsecs", "MiB", "-3MiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"a": {"kv_bytes": "1KiB"}, "b": {"kv_bytes": 5}}}))
    assert {k: q.kv_bytes for k, q in load_keys(keys).items()} == {"a": 1024, "b": 5}
    keys.write_text(json.dumps({"keys": {"a": {"kv_bytes": "lots"}}}))
    with pytest.raises(ValueError):
        load_keys(keys)
