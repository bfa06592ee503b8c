"""API keys and per-key quotas on a real `pie serve` (tiny model): 401 without a valid key, 429 over a key's
concurrency, KV-page or tokens-per-minute quota, and a key at its page quota does not starve another key;
503 when every run slot is taken and nothing may wait. Also the quota arithmetic on its own."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from pie_runtime.serve.auth import KeyQuota, Quotas, pages_needed
from pie_runtime.serve.errors import APIError
from tests.conftest import TINY
from tests.serve.server_proc import start_serve

PAGE = 16
LONG = 200  # tokens of the request that holds its key's pages while the others are sent
HOLD_PAGES = pages_needed(8, LONG, 1, PAGE)  # one long request (a prompt of a few tokens) fits, no more


@pytest.fixture(scope="module")
def server(pie_home, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    quotas = {
        "alpha": {"concurrent": 4, "kv_pages": HOLD_PAGES},
        "beta": {},
        "gamma": {"tokens_per_minute": 40},
        "delta": {"concurrent": 1},
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
    q = Quotas({"k": KeyQuota(concurrent=2, kv_pages=10, tokens_per_minute=100)})
    assert q.authenticate("Bearer k") == "k"
    with pytest.raises(APIError) as e:
        q.authenticate("Bearer nope")
    assert e.value.status == 401
    a = q.admit("k", prompt_tokens=10, pages=6)
    with pytest.raises(APIError) as e:
        q.admit("k", prompt_tokens=10, pages=5)
    assert e.value.status == 429 and e.value.param == "kv_pages"
    with pytest.raises(APIError) as e:  # its token budget does not fit the minute's quota
        q.admit("k", prompt_tokens=10, pages=0, max_new_tokens=81)
    assert e.value.param == "tokens_per_minute"
    b = q.admit("k", prompt_tokens=10, pages=4, max_new_tokens=10)
    with pytest.raises(APIError) as e:
        q.admit("k", prompt_tokens=1, pages=0)
    assert e.value.param == "concurrent"
    a.charge(75)
    a.release()
    b.release()
    with pytest.raises(APIError) as e:  # 10 + 10 + 75 charged this minute
        q.admit("k", prompt_tokens=10, pages=0)
    assert e.value.param == "tokens_per_minute"
    assert q.usage["k"].running == 0 and q.usage["k"].pages == 0
    assert pages_needed(prompt_tokens=20, max_tokens=12, n=1, page_size=16) == 2
    assert pages_needed(prompt_tokens=20, max_tokens=12, n=3, page_size=16) == 2 + 2 * 2
