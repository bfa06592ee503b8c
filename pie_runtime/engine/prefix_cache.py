"""The prefix cache: full KV pages named by their content, reused copy-on-write by later working sets
(docs/working-sets.md, "The working set and its deferred fold"; issue 12, section 5).

A page's key is a hash chain over page-aligned token blocks: ``key(i) = H(key(i-1), tokens of page i)``, with
``key(-1)`` the model's name, so a key names the whole prefix up to the end of its page. A working set opened
with a ``cache_salt`` (vLLM's ``cache_salt``: `pie serve` sends one per API key) starts its chain from
``H(root, salt)`` instead: its pages match only those of working sets with the same salt. Only rows embedded
from token ids at their default positions (position = row index) are cacheable; the first row that is not
ends the working set's chain.

Each working set carries a :class:`PageChain` (the token ids of its rows from 0, as far as they are cacheable,
and the keys of its full committed pages). When a page becomes full and committed, :meth:`PrefixCache.register`
names it. The page pool keeps a named page whose last holder let it go as *idle*: evictable, least recently
released first, and counted free. A new working set's first fire looks up the longest cached chain of its
tokens (:meth:`PrefixCache.lookup`) and maps those pages instead of computing their rows. A named page is
never written in place: ``KVPages.reserve`` copies it first, as it copies a page shared by a fork.

Torch-free: token ids, page handles and keys only.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from .page_pool import PagePool


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a page whose rows hold ``tokens``, after the prefix named ``parent``."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def root_key(model: str) -> bytes:
    return hashlib.blake2b(model.encode(), digest_size=16, person=b"pie-prefix").digest()


def salted_root(root: bytes, salt: str | None) -> bytes | None:
    """The chain root of a working set opened with ``salt`` (None without one: the model's root)."""
    if not salt:
        return None
    return hashlib.blake2b(salt.encode(), digest_size=16, key=root, person=b"pie-salt").digest()


@dataclass
class PageChain:
    """What a working set's rows hold, as far as the prefix cache can name it: the token ids of rows ``0 ..``
    (up to the first row that was not embedded from a token id at its default position, or the first gap),
    and the keys of its leading full committed pages."""

    tokens: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    root: bytes | None = None  # a salted chain's root (salted_root); None: the model's

    def wrote(self, start: int, tokens: Sequence[int] | None, page_size: int) -> None:
        """Rows ``start ..`` were (re)written with ``tokens`` (None: not cacheable, the chain ends there)."""
        if start > len(self.tokens):
            return  # a gap after an uncacheable row: nothing past it can be named
        del self.tokens[start:]
        del self.keys[start // page_size :]
        if tokens is not None:
            self.tokens.extend(tokens)

    def cut(self, rows: int, page_size: int) -> None:
        """The working set was truncated to ``rows``: pages past it lose their names."""
        del self.keys[rows // page_size :]

    def prefix(self, rows: int, page_size: int) -> PageChain:
        """The chain of a fork that keeps ``rows`` rows."""
        return PageChain(self.tokens[:rows], self.keys[: rows // page_size], self.root)


@dataclass
class PrefixStats:
    queries: int = 0  # first fires that looked the cache up
    hits: int = 0  # ... and mapped at least one page
    query_tokens: int = 0  # rows of those fires
    hit_tokens: int = 0  # rows they did not compute


class PrefixCache:
    """The named pages of one model's pool: key → page and back, and the lookup and registration rules."""

    def __init__(self, pool: PagePool, page_size: int, model: str):
        self.pool = pool
        self.page_size = page_size
        self.root = root_key(model)
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self.stats = PrefixStats()
        pool.keep = self.holds
        pool.on_evict = self._evicted

    @property
    def cached_pages(self) -> int:
        return len(self._key_of)

    def holds(self, page: int) -> bool:
        """Whether ``page`` is named: its content must not change while it is."""
        return page in self._key_of

    def lookup(self, tokens: Sequence[int], max_rows: int, root: bytes | None = None) -> tuple[list[bytes], list[int]]:
        """The keys and pages of the longest cached chain over ``tokens``, covering at most ``max_rows`` rows,
        from ``root`` (a salted chain's; None: the model's). Counts the query; the caller maps (shares) the pages."""
        p = self.page_size
        keys: list[bytes] = []
        pages: list[int] = []
        parent = root or self.root
        for i in range(max(0, max_rows) // p):
            key = page_key(parent, tokens[i * p : (i + 1) * p])
            page = self._page_of.get(key)
            if page is None:
                break
            keys.append(key)
            pages.append(page)
            parent = key
        s = self.stats
        s.queries += 1
        s.query_tokens += len(tokens)
        s.hits += bool(pages)
        s.hit_tokens += len(pages) * p
        return keys, pages

    def register(self, chain: PageChain, pages: list[int], committed: int) -> None:
        """Names every full committed page of a working set that its chain covers and that has no name yet.
        A page whose content is already cached under another page stays unnamed (it is freed on release)."""
        p = self.page_size
        for i in range(len(chain.keys), min(committed, len(chain.tokens), len(pages) * p) // p):
            parent = chain.keys[-1] if chain.keys else chain.root or self.root
            key = page_key(parent, chain.tokens[i * p : (i + 1) * p])
            chain.keys.append(key)
            if key not in self._page_of and pages[i] not in self._key_of:
                self._page_of[key] = pages[i]
                self._key_of[pages[i]] = key

    def _evicted(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._page_of[key]
