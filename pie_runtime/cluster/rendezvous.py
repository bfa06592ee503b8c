"""Rendezvous (highest-random-weight) hashing: each key ranks the engines by ``hash(key, engine)``.

Adding or removing an engine moves only the keys whose top engine it was, so a session keeps its engine (and
that engine's cached prefix) while the set of engines changes around it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def _weight(key: str, engine: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{engine}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, engines: Iterable[str]) -> list[str]:
    """The engines, the key's preferred one first (ties, which need equal 64-bit hashes, by name)."""
    return sorted(engines, key=lambda e: (-_weight(key, e), e))
