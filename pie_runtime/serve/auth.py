"""API keys and per-key quotas of `pie serve`.

``--api-key KEY`` (repeatable) or ``--keys FILE`` (JSON: ``{"keys": {"KEY": {"concurrent": 4,
"tokens_per_minute": 20000, "kv_pages": 512}}}``) guard ``/v1/*`` with Bearer tokens; without any key every
request is the anonymous client ``""`` under the default quotas. Each key has three quotas, checked when a
request is admitted (over one: 429, the request never starts):

- ``concurrent``: runs in flight;
- ``tokens_per_minute``: prompt and completion tokens charged in the last 60 s (a sliding window). A request
  is admitted only if its prompt and its whole token budget (``max_tokens`` for each choice) fit under the
  quota beside what the window holds, and it is charged both at admission, so streams running at once or
  abandoned halfway cannot generate past the quota; a run that ends with a result is then charged what it
  generated instead of its budget (``Lease.settle``), one that is cancelled or fails keeps its budget charged;
- ``kv_pages``: KV pages held. A request holds, from admission to its end, the pages its working sets can
  grow to: ``ceil((prompt + max_tokens) / page_size)`` for the prompt's set plus, for ``n > 1``, the
  completion pages of each fork. Counting the bound rather than the engine's live per-client pages makes
  admission exact and immediate (a run never fails halfway with ``out_of_pages`` because another key grew),
  and a key at its page quota is refused without touching what other keys hold;
- ``cache_bytes``: bytes of saved prompt caches the key keeps (``POST /v1/prompt_caches``): a save is refused
  when the key's caches already fill it, and a save that takes it past it is removed again (both 429).
"""

from __future__ import annotations

import hmac
import json
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, Field

from .errors import authentication, rate_limited


class KeyQuota(BaseModel):
    """One key's limits; ``None`` is unlimited."""

    concurrent: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    kv_pages: int | None = Field(default=None, ge=1)
    cache_bytes: int | None = Field(default=None, ge=1)  # bytes of saved prompt caches the key may keep


def check_cache_bytes(quota: KeyQuota, used: int, adding: int = 0) -> None:
    """429 ``cache_bytes`` when the key's saved caches (``used`` bytes, plus ``adding``) go past its quota."""
    limit = quota.cache_bytes
    if limit is not None and (used + adding > limit if adding else used >= limit):
        raise rate_limited(
            f"this key's saved prompt caches take {used + adding} bytes (quota {quota.cache_bytes})", "cache_bytes"
        )


class KeyFile(BaseModel):
    keys: dict[str, KeyQuota]


def load_keys(path: Path) -> dict[str, KeyQuota]:
    return KeyFile.model_validate(json.loads(path.read_text())).keys


def pages_needed(prompt_tokens: int, max_tokens: int, n: int, page_size: int) -> int:
    """The KV pages a request's working sets can grow to (the prompt's set, and n - 1 forks' completions)."""
    first = math.ceil((prompt_tokens + max_tokens) / page_size)
    forks = (n - 1) * (math.ceil(max_tokens / page_size) + 1)  # +1: the shared tail page copied on write
    return first + forks


@dataclass
class KeyUsage:
    running: int = 0
    pages: int = 0
    window: deque[list[float]] = field(default_factory=deque)  # [time, tokens charged]: settle() edits one

    def tokens_last_minute(self, now: float) -> int:
        while self.window and self.window[0][0] <= now - 60.0:
            self.window.popleft()
        return int(sum(t for _, t in self.window))


class Lease:
    """A request's hold on its key's quotas, from admission until ``release()``."""

    def __init__(self, usage: KeyUsage, pages: int, prompt_tokens: int = 0, budget: int = 0) -> None:
        self._usage = usage
        self._pages = pages
        self._open = True
        self._prompt = prompt_tokens
        self._budget = budget
        self._entry = [time.monotonic(), float(prompt_tokens + budget)]  # charged at admission
        usage.window.append(self._entry)

    def charge(self, tokens: int) -> None:
        if tokens > 0:
            self._usage.window.append([time.monotonic(), float(tokens)])

    def settle(self, generated: int) -> None:
        """The run ended with ``generated`` tokens: charged them instead of its whole budget."""
        self._entry[1] = float(self._prompt + min(generated, self._budget))
        self.charge(generated - self._budget)

    def release(self) -> None:
        if self._open:
            self._open = False
            self._usage.running -= 1
            self._usage.pages -= self._pages


class Quotas:
    """Authenticates requests and admits them under their key's quotas."""

    def __init__(self, keys: dict[str, KeyQuota], default: KeyQuota | None = None) -> None:
        self.keys = dict(keys)
        self.default = default or KeyQuota()
        self.usage: dict[str, KeyUsage] = {}

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def authenticate(self, authorization: str | None) -> str:
        """The key a request presents (``Authorization: Bearer KEY``); raises 401 when keys are required and
        it presents none of them."""
        if not self.required:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise authentication("missing API key: send Authorization: Bearer KEY")
        for key in self.keys:  # constant-time comparison against each key
            if hmac.compare_digest(key.encode(), token.strip().encode()):
                return key
        raise authentication("invalid API key")

    def quota(self, key: str) -> KeyQuota:
        return self.keys.get(key) or self.default

    def admit(self, key: str, prompt_tokens: int, pages: int, max_new_tokens: int = 0) -> Lease:
        """Admits a request or raises 429 naming the quota it would go over."""
        q, use = self.quota(key), self.usage.setdefault(key, KeyUsage())
        now = time.monotonic()
        if q.concurrent is not None and use.running >= q.concurrent:
            raise rate_limited(
                f"this key already has {use.running} requests running (quota {q.concurrent})", "concurrent"
            )
        if q.kv_pages is not None and use.pages + pages > q.kv_pages:
            raise rate_limited(
                f"this request needs {pages} KV pages and the key holds {use.pages} (quota {q.kv_pages})", "kv_pages"
            )
        if q.tokens_per_minute is not None:
            used = use.tokens_last_minute(now)
            if used + prompt_tokens + max_new_tokens > q.tokens_per_minute:
                raise rate_limited(
                    f"this key used {used} tokens in the last minute and this request may take "
                    f"{prompt_tokens + max_new_tokens} (quota {q.tokens_per_minute})",
                    "tokens_per_minute",
                )
        use.running += 1
        use.pages += pages
        return Lease(use, pages, prompt_tokens, max_new_tokens)
