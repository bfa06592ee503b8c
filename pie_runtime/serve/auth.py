"""API keys and per-key quotas of `pie serve`.

``--api-key KEY`` (repeatable) or ``--keys FILE`` (JSON: ``{"keys": {"KEY": {"concurrent": 4,
"tokens_per_minute": 20000, "kv_pages": 512, "kv_bytes": "64MiB"}}}``) guard ``/v1/*`` with Bearer tokens;
without any key every request is the anonymous client ``""`` under the default quotas. Each key has these
quotas, checked when a request is admitted (over one: 429, the request never starts):

- ``concurrent``: runs in flight;
- ``tokens_per_minute``: prompt and completion tokens charged in the last 60 s (a sliding window). A request
  is admitted only if its prompt and its whole token budget (``max_tokens`` for each choice) fit under the
  quota beside what the window holds, and it is charged both at admission, so streams running at once or
  abandoned halfway cannot generate past the quota; a run that ends with a result is then charged what it
  generated instead of its budget (``Lease.settle``), one that is cancelled or fails keeps its budget charged;
- ``kv_pages`` and ``kv_bytes``: KV held, in pool pages and in bytes (``--key-kv-pages``, ``--key-kv-memory``). A
  request holds, from admission to its end, what its working sets can grow to (``kv_needed``): in every KV page
  group (models/kv_groups.py) the pages of its rows, ``prompt + max_tokens`` for the prompt's set plus, for
  ``n > 1``, the completion rows of each fork; a sliding group (window W, as Gemma 3's) never more than its window
  span's, so a long Gemma run is charged what it holds, not what an all-global cache would. Bytes are those pages
  of ``ModelInfo.page_bytes`` (every group's pages are alike). Counting the bound rather than the engine's live
  per-client pages makes admission exact and immediate (a run never fails halfway with ``out_of_pages`` because
  another key grew), and a key at its quota is refused without touching what other keys hold;
- ``cache_bytes``: bytes of saved prompt caches the key keeps (``POST /v1/prompt_caches``): a save is refused
  when the key's caches already fill it, and a save that takes it past it is removed again (both 429).
"""

from __future__ import annotations

import hmac
import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from ..models.kv_groups import pages_bound
from ..protocol.messages import ModelInfo
from .errors import authentication, rate_limited

_UNITS = {"": 1 << 20, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20}
_UNITS |= {"g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_bytes(text: str | int) -> int:
    """``64MiB``, ``1.5GiB``, ``500MB``, ``4096B`` as bytes; a bare number is MiB (as ``--kv-memory``'s)."""
    if isinstance(text, int):
        return text
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = found.group(2).lower() if found else None
    if found is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is no size: a number with B, KiB, MiB, GiB, KB, MB or GB (a bare number: MiB)")
    return int(float(found.group(1)) * _UNITS[unit])


class KeyQuota(BaseModel):
    """One key's limits; ``None`` is unlimited."""

    concurrent: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    kv_pages: int | None = Field(default=None, ge=1)
    kv_bytes: int | None = Field(default=None, ge=1)  # bytes of KV held; the keys file may say "64MiB"
    cache_bytes: int | None = Field(default=None, ge=1)  # bytes of saved prompt caches the key may keep

    @field_validator("kv_bytes", mode="before")
    @classmethod
    def _size(cls, value: object) -> object:
        return parse_bytes(value) if isinstance(value, str) else value


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


@dataclass(frozen=True)
class KVShape:
    """What admission needs to know of the served model's KV pool (its ``ModelInfo``)."""

    page_size: int
    page_bytes: int = 0
    windows: tuple[int | None, ...] = (None,)  # per KV page group: the rows it keeps (None: every row)
    chunk_rows: int = 256  # the most rows of a fire one forward runs: a sliding group's pages span a window and it

    @staticmethod
    def of(info: ModelInfo) -> KVShape:
        return KVShape(info.page_size, info.page_bytes, tuple(info.page_windows), info.chunk_rows)


@dataclass(frozen=True)
class KVNeed:
    """The KV a request's working sets can grow to, across page groups: pool pages and their bytes."""

    pages: int = 0
    bytes: int = 0


def kv_needed(prompt_tokens: int, max_tokens: int, n: int, kv: KVShape) -> KVNeed:
    """The KV a request's working sets can grow to: the prompt's set, and n - 1 forks' completions (each with the
    shared tail page it copies on write), in every page group, a sliding group's bounded by its window."""

    def bound(rows: int) -> int:
        return pages_bound(rows, kv.windows, kv.page_size, kv.chunk_rows)

    pages = bound(prompt_tokens + max_tokens) + (n - 1) * bound(max_tokens + kv.page_size)
    return KVNeed(pages, pages * kv.page_bytes)


@dataclass
class KeyUsage:
    running: int = 0
    pages: int = 0
    bytes: int = 0
    window: deque[list[float]] = field(default_factory=deque)  # [time, tokens charged]: settle() edits one

    def tokens_last_minute(self, now: float) -> int:
        while self.window and self.window[0][0] <= now - 60.0:
            self.window.popleft()
        return int(sum(t for _, t in self.window))


class Lease:
    """A request's hold on its key's quotas, from admission until ``release()``."""

    def __init__(self, usage: KeyUsage, kv: KVNeed, prompt_tokens: int = 0, budget: int = 0) -> None:
        self._usage = usage
        self._kv = kv
        self._open = True
        self._prompt = prompt_tokens
        self._budget = budget
        self._entry = [time.monotonic(), float(prompt_tokens + budget)]  # charged at admission
        usage.window.append(self._entry)

    @property
    def kv(self) -> KVNeed:
        """The KV this request's working sets can grow to (what the server's KV admission holds for it)."""
        return self._kv

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
            self._usage.pages -= self._kv.pages
            self._usage.bytes -= self._kv.bytes


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

    def admit(self, key: str, prompt_tokens: int, kv: KVNeed, max_new_tokens: int = 0) -> Lease:
        """Admits a request or raises 429 naming the quota it would go over."""
        q, use = self.quota(key), self.usage.setdefault(key, KeyUsage())
        now = time.monotonic()
        if q.concurrent is not None and use.running >= q.concurrent:
            raise rate_limited(
                f"this key already has {use.running} requests running (quota {q.concurrent})", "concurrent"
            )
        if q.kv_pages is not None and use.pages + kv.pages > q.kv_pages:
            raise rate_limited(
                f"this request needs {kv.pages} KV pages and the key holds {use.pages} (quota {q.kv_pages})", "kv_pages"
            )
        if q.kv_bytes is not None and use.bytes + kv.bytes > q.kv_bytes:
            raise rate_limited(
                f"this request needs {kv.bytes} bytes of KV and the key holds {use.bytes} (quota {q.kv_bytes})",
                "kv_bytes",
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
        use.pages += kv.pages
        use.bytes += kv.bytes
        return Lease(use, kv, prompt_tokens, max_new_tokens)
