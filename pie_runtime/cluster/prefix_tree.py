"""An approximate prefix tree of the token prefixes the router sent to each engine.

The router cannot see the engines' caches; it remembers what it routed (SGLang's "approximate tree" in its
``cache_aware`` policy; Ray Serve's ``PrefixCacheAffinityRouter`` keeps the same kind of tree). Nodes hold a
block of ``block`` token ids, the engine's page size, because the engine's prefix cache shares only full pages
(``engine/prefix_cache.py``): a match shorter than a page saves nothing. Each node records, per engine
("tenant"), when a prompt through it last went there; an engine's entries beyond ``max_blocks`` are evicted
least recently used first, leaves first, as SGLang's eviction thread does.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

Block = tuple[int, ...]


@dataclass(eq=False)
class _Node:
    parent: _Node | None
    key: Block
    children: dict[Block, _Node] = field(default_factory=dict)
    tenants: dict[str, int] = field(default_factory=dict)  # engine → last use (a logical clock)


class PrefixTree:
    def __init__(self, block: int = 16, max_blocks: int = 65536) -> None:
        if block < 1 or max_blocks < 1:
            raise ValueError("block and max_blocks must be positive")
        self.block = block
        self.max_blocks = max_blocks
        self._root = _Node(None, ())
        self._clock = itertools.count(1)
        self._sizes: dict[str, int] = {}  # engine → blocks it holds in the tree

    def _blocks(self, tokens: Sequence[int]) -> list[Block]:
        b = self.block
        return [tuple(tokens[i : i + b]) for i in range(0, len(tokens) - b + 1, b)]

    def size(self, engine: str) -> int:
        """Blocks the tree remembers for ``engine``: how much of its cache the router thinks it filled."""
        return self._sizes.get(engine, 0)

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        """Engine → tokens of ``tokens``' longest prefix routed there (whole blocks only)."""
        out: dict[str, int] = {}
        node = self._root
        for depth, key in enumerate(self._blocks(tokens), start=1):
            child = node.children.get(key)
            if child is None:
                break
            for engine in child.tenants:
                out[engine] = depth * self.block
            node = child
        return out

    def insert(self, tokens: Sequence[int], engine: str) -> None:
        """Records that ``tokens`` went to ``engine`` (touching the prefix it already had), then evicts."""
        now = next(self._clock)
        node = self._root
        for key in self._blocks(tokens):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(node, key)
            if engine not in child.tenants:
                self._sizes[engine] = self._sizes.get(engine, 0) + 1
            child.tenants[engine] = now
            node = child
        if self.size(engine) > self.max_blocks:
            self._evict(engine, self.size(engine) - self.max_blocks)

    def remove(self, engine: str) -> None:
        """Forgets everything routed to ``engine`` (it left, or lost its cache)."""
        for node in list(self._walk()):
            if node.tenants.pop(engine, None) is not None:
                self._prune(node)
        self._sizes.pop(engine, None)

    def _walk(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _evict(self, engine: str, count: int) -> None:
        """Drops ``count`` of the engine's blocks, least recently used leaves first (a parent becomes a leaf
        for the engine once no child holds it)."""
        heap = [(n.tenants[engine], id(n), n) for n in self._walk() if engine in n.tenants and self._leaf(n, engine)]
        heapq.heapify(heap)
        while heap and count > 0:
            _, _, node = heapq.heappop(heap)
            del node.tenants[engine]
            self._sizes[engine] -= 1
            count -= 1
            parent = node.parent
            self._prune(node)
            if parent is not None and parent is not self._root and self._leaf(parent, engine):
                heapq.heappush(heap, (parent.tenants[engine], id(parent), parent))

    @staticmethod
    def _leaf(node: _Node, engine: str) -> bool:
        return engine in node.tenants and not any(engine in c.tenants for c in node.children.values())

    def _prune(self, node: _Node) -> None:
        """Unlinks nodes that no engine holds and that have no children, upwards."""
        while node.parent is not None and not node.tenants and not node.children:
            del node.parent.children[node.key]
            node = node.parent
