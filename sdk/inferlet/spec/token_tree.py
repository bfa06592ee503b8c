"""Token trees for speculative decoding: build one from a drafter's candidates, flatten it into a tree window
(one fire verifies every branch), and verify it.

SpecInfer (Miao et al. 2023), Medusa (Cai et al. 2024) and EAGLE-2 (Li et al. 2024) spend a window's rows on
several candidates per position instead of one chain, so a wrong first guess no longer wastes the rest. The
window is ``[last] + nodes``: row 0 is the last emitted token (it follows the committed sequence), row
``i + 1`` is node ``i``, whose parent row is its parent node's row (row 0 for a child of the root). The
engine gives each row the position ``committed + depth`` and lets it attend only its ancestors
(``pie_runtime.protocol.tree``); a readout on every row gives the target's prediction after each node.

Verification walks down from the root and yields the kept nodes plus one token of the target's own:

    greedy:   t = argmax at the current row; descend to the child holding t, or emit t and stop
    sampled, point-mass children (lookup, top-k of an MTP head): x ~ p at the current row; descend to the child
              holding x, or emit x and stop — every emitted token is a draw from the target, so this is exact
    sampled, children drawn from q without replacement (a sampling draft model): recursive rejection
              sampling without replacement (Jeon et al. 2024, "Recursive Speculative Decoding"; SpecInfer's
              multi-step speculative sampling is the same rule with replacement):
                  for child c_i (token x_i, drawn from q_i):
                      accept with min(1, p_i(x_i) / q_i(x_i)): descend to c_i
                      else p_(i+1) = norm(max(0, p_i - q_i)),  q_(i+1) = q_i without x_i, renormalized
                  all rejected: emit x ~ p_(m+1) and stop

The fold is the path of kept rows, ``[0] + their rows``: the engine moves them into consecutive committed rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

ROOT = -1
"""The parent of a depth-1 node: the last emitted token (window row 0)."""


MAX_TREE_DEPTH = 64  # a draft tree's depths
MAX_TREE_NODES = 512
"""The most nodes a draft tree (its full shape) may have."""


def parse_shape(shape: str) -> list[int]:
    """``--tree`` widths per depth, e.g. ``"3,2,1"``: at most 3 children of the root, 2 of each depth-1 node,
    1 of each depth-2 node (so at most 3 + 6 + 6 nodes)."""
    try:
        widths = [int(w) for w in shape.split(",") if w.strip()]
    except ValueError:
        widths = []
    if not widths or any(w < 1 for w in widths):
        raise ValueError(f"a tree shape is positive widths per depth, like 3,2,1; got {shape!r}")
    if len(widths) > MAX_TREE_DEPTH or shape_rows(widths) > MAX_TREE_NODES:
        raise ValueError(f"a tree shape is at most {MAX_TREE_DEPTH} deep and {MAX_TREE_NODES} nodes; got {shape!r}")
    return widths


def shape_rows(widths: Sequence[int]) -> int:
    """Nodes of the full tree of ``widths``."""
    total, level = 0, 1
    for w in widths:
        level *= w
        total += level
    return total


@dataclass
class TokenTree:
    """Draft nodes in topological order (a parent before its children)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # a node's parent node, ROOT for the root's children
    child_q: dict[int, np.ndarray] = field(default_factory=dict)  # node → q its children were drawn from
    _children: dict[int, list[int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        """The child of ``parent`` holding ``token``: an existing one, or a new node."""
        for c in self.children(parent):
            if self.tokens[c] == token:
                return c
        self.tokens.append(int(token))
        self.parents.append(parent)
        node = len(self.tokens) - 1
        self._children.setdefault(parent, []).append(node)
        return node

    def children(self, node: int) -> list[int]:
        return self._children.get(node, [])

    def depth(self, node: int) -> int:
        d = 0
        while node != ROOT:
            node, d = self.parents[node], d + 1
        return d

    @property
    def max_depth(self) -> int:
        return max((self.depth(n) for n in range(len(self))), default=0)

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self) - 1))

    def chain(self) -> list[int]:
        """The tokens of a chain tree, root first."""
        assert self.is_chain()
        return list(self.tokens)

    def pruned(self, depth: int, rows: int) -> TokenTree:
        """The first ``rows`` nodes no deeper than ``depth`` (a prefix of a topological order is a tree)."""
        keep = [n for n in range(len(self)) if self.depth(n) <= depth][: max(rows, 0)]
        if len(keep) == len(self):
            return self
        new = {ROOT: ROOT}
        out = TokenTree()
        for n in keep:
            new[n] = out.add(new[self.parents[n]], self.tokens[n])
        out.child_q = {new[n]: q for n, q in self.child_q.items() if n in new}
        return out

    def window(self, last: int) -> tuple[list[int], list[int]]:
        """The tree window ``[last] + nodes``: its tokens and parent rows (module docstring)."""
        return [int(last), *self.tokens], [-1, *(p + 1 for p in self.parents)]

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], widths: Sequence[int]) -> TokenTree:
        """A trie of candidate continuations (earlier occurrences of a prompt-lookup match), best first: a node
        at depth d keeps at most ``widths[d]`` children, and no path runs deeper than ``len(widths)``."""
        tree = cls()
        for path in paths:
            node = ROOT
            for d, token in enumerate(path[: len(widths)]):
                existing = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
                if existing is None and len(tree.children(node)) >= widths[d]:
                    break
                node = tree.add(node, int(token))
        return tree

    @classmethod
    def from_topk(cls, candidates: Sequence[Sequence[int]], widths: Sequence[int]) -> TokenTree:
        """Medusa's tree from per-depth candidates (an MTP head's top-k at each depth, best first): every node
        at depth d gets the first ``widths[d]`` candidates of depth d + 1 as children."""
        tree = cls()
        level = [ROOT]
        for d, w in enumerate(widths[: len(candidates)]):
            level = [tree.add(node, int(t)) for node in level for t in list(candidates[d])[:w]]
        return tree


@dataclass
class TreeVerdict:
    """A verified tree: ``nodes`` kept root first, ``tokens`` their tokens and the target's own next token,
    ``path`` the window rows to fold (row 0, then the kept nodes' rows)."""

    tokens: list[int]
    nodes: list[int]
    rows: int  # the window's rows

    @property
    def accepted(self) -> int:
        return len(self.nodes)

    @property
    def path(self) -> list[int]:
        return [0, *(n + 1 for n in self.nodes)]


def _descend(tree: TokenTree, node: int, token: int) -> int | None:
    return next((c for c in tree.children(node) if tree.tokens[c] == token), None)


def verify_tree_greedy(tree: TokenTree, target_tokens: Sequence[int] | np.ndarray) -> TreeVerdict:
    """The longest path whose every token is the target's argmax at its parent, plus the target's next token.
    ``target_tokens[r]`` is the argmax at window row r (one per row)."""
    if len(target_tokens) != len(tree) + 1:
        raise ValueError(f"need {len(tree) + 1} target tokens for a tree of {len(tree)} nodes")
    node, nodes = ROOT, []
    while (child := _descend(tree, node, int(target_tokens[node + 1]))) is not None:
        nodes.append(child)
        node = child
    return TreeVerdict([*(tree.tokens[n] for n in nodes), int(target_tokens[node + 1])], nodes, len(tree) + 1)


def verify_tree_sampled(tree: TokenTree, p: np.ndarray, rng: np.random.Generator) -> TreeVerdict:
    """Sampled verification (module docstring). ``p`` (rows, V): the target's distribution at each window row.
    Nodes whose children carry a ``child_q`` are verified by recursive rejection sampling without replacement;
    the others' children are point masses."""
    p = np.asarray(p, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != len(tree) + 1:
        raise ValueError(f"p must be ({len(tree) + 1}, V), got {p.shape}")
    node, nodes = ROOT, []
    while True:
        kids = tree.children(node)
        q = tree.child_q.get(node)
        if q is None:
            x = _sample(p[node + 1], rng)
            child = _descend(tree, node, x)
        else:
            child, x = _recursive_rejection(tree, kids, p[node + 1], q, rng)
        if child is None:
            return TreeVerdict([*(tree.tokens[n] for n in nodes), x], nodes, len(tree) + 1)
        nodes.append(child)
        node = child


def _recursive_rejection(
    tree: TokenTree, kids: list[int], p: np.ndarray, q: np.ndarray, rng: np.random.Generator
) -> tuple[int | None, int]:
    """(the accepted child, its token), or (None, a token drawn from the final residual)."""
    p_cur = p.copy()
    q_cur = np.asarray(q, dtype=np.float64).copy()
    for c in kids:
        x = tree.tokens[c]
        if q_cur[x] > 0 and rng.random() < min(1.0, p_cur[x] / q_cur[x]):
            return c, x
        residual = np.maximum(p_cur - q_cur, 0.0)
        p_cur = residual / residual.sum() if residual.sum() > 0 else p_cur
        q_cur[x] = 0.0
        if not q_cur.sum() > 0:
            break
        q_cur /= q_cur.sum()
    return None, _sample(p_cur, rng)


def _sample(weights: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(weights)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(i, int(np.flatnonzero(weights > 0)[-1]))


def draw_without_replacement(q: np.ndarray, n: int, rng: np.random.Generator) -> list[int]:
    """``n`` distinct tokens drawn one after another from ``q``, each from what is left of it (renormalized):
    the drafting rule ``verify_tree_sampled``'s recursive rejection assumes."""
    q = np.asarray(q, dtype=np.float64).copy()
    out: list[int] = []
    for _ in range(min(n, int((q > 0).sum()))):
        x = _sample(q, rng)
        out.append(x)
        q[x] = 0.0
    return out
