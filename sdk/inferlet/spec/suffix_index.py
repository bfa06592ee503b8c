"""SuffixDecoding's index: where the last tokens occurred before, and what followed them, how often.

Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications"
(arXiv:2411.04975). A suffix tree over earlier text answers, for the longest suffix P of the current context
that occurred before, every continuation of P with how many occurrences it followed; a continuation's score is
that count over P's count (its empirical probability), and the draft is the best-scoring tree of
continuations. Here the suffix tree is implicit:

    SuffixIndex: documents (token sequences) and an anchor table: the min_match tokens ending at a position
                 that has a following token → up to MAX_OCCURRENCES of those positions (the newest)
    match(context):       the anchor of context's last min_match tokens; extend each occurrence backwards
                          while it agrees with context (up to max_match): L = the longest agreement,
                          occurrences = those that reach L (P's node in the suffix tree)
    candidates(context):  the trie of what followed the occurrences (up to `depth` tokens), each node's
                          count = occurrences through it, prob = count / occurrences; nodes taken best first
                          (highest prob first, so a parent before its children) while prob >= min_prob,
                          up to `rows` nodes: a TokenTree and its probs; score = Σ probs, the expected
                          number of drafts kept if the counts are the truth
    chain:                the most frequent path of that tree

An index holds either one growing document (a run's prompt and output: ``add`` then ``extend``) or a store
of documents (earlier outputs) bounded by ``max_tokens``: adding past it evicts the least recently used
document, and a match touches the documents it drafted from. Memory is a few tens of bytes a token (the
tokens as int32 arrays, one anchor entry each). A store is shared by a host's runs through
``Model.shared`` (inferlet.shared), saved with ``save`` and loaded with ``SuffixIndex.load``.

Build a static index from a corpus (documents: paragraphs split by blank lines, or a .jsonl's "text"
fields) with the model's tokenizer.json:

    python -m inferlet.spec.suffix_index build CORPUS OUT --tokenizer tokenizer.json [--min-match 2]
"""

from __future__ import annotations

import argparse
import heapq
import io
import json
import os
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .token_tree import ROOT, TokenTree

MAX_OCCURRENCES = 64  # positions an anchor keeps (the newest): bounds a match's work and a count's range
_END_BITS = 32  # an occurrence is packed as doc << 32 | end


@dataclass
class Candidates:
    """A match's draft tree: nodes best first, each with its probability (count over the match's count)."""

    tree: TokenTree = field(default_factory=TokenTree)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0  # L: the matched suffix's length (0: no match)
    occurrences: int = 0  # how many times it occurred (the counts' denominator)

    @property
    def score(self) -> float:
        """Expected drafts kept over the whole tree, if the counts are the truth."""
        return float(sum(self.probs))

    def chain(self) -> tuple[list[int], list[float]]:
        """The most frequent path (each node's first child is its most frequent), with its probabilities."""
        tokens: list[int] = []
        probs: list[float] = []
        node = ROOT
        while kids := self.tree.children(node):
            node = kids[0]
            tokens.append(self.tree.tokens[node])
            probs.append(self.probs[node])
        return tokens, probs


class SuffixIndex:
    """Documents and their anchor table (module docstring); ``max_tokens`` bounds a store (None: unbounded)."""

    def __init__(self, min_match: int = 2, max_tokens: int | None = None) -> None:
        if min_match < 1:
            raise ValueError(f"min_match must be at least 1, got {min_match}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be positive or None, got {max_tokens}")
        self.min_match = min_match
        self.max_tokens = max_tokens
        self.tokens = 0  # tokens held, over all documents
        self.evicted = 0  # documents evicted so far
        self._docs: OrderedDict[int, array] = OrderedDict()  # least recently used first
        self._anchors: dict[int, list[int]] = {}  # _key(anchor tokens) → packed occurrences, oldest first
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._docs)

    def documents(self) -> list[list[int]]:
        """The documents held, least recently used first."""
        return [list(d) for d in self._docs.values()]

    def add(self, tokens: Iterable[int] = ()) -> int:
        """A new document of ``tokens`` (extend it later with ``extend``); returns its id. May evict others."""
        doc = self._next_id
        self._next_id += 1
        self._docs[doc] = array("i")
        self.extend(doc, tokens)
        return doc

    def extend(self, doc: int, tokens: Iterable[int]) -> None:
        """Appends ``tokens`` to document ``doc``: each position that gains a following token becomes findable."""
        arr, a = self._docs[doc], self.min_match
        self._docs.move_to_end(doc)
        before = len(arr)
        for tok in tokens:
            end = len(arr) - 1
            if end >= a - 1:
                entries = self._anchors.setdefault(_key(arr[end - a + 1 : end + 1]), [])
                entries.append(doc << _END_BITS | end)
                if len(entries) > MAX_OCCURRENCES:
                    del entries[0]
            arr.append(int(tok))
        self.tokens += len(arr) - before
        if self.max_tokens is not None:
            while self.tokens > self.max_tokens and len(self._docs) > 1:
                self._evict(next(iter(self._docs)))

    def _evict(self, doc: int) -> None:
        arr, a = self._docs.pop(doc), self.min_match
        self.tokens -= len(arr)
        self.evicted += 1
        for end in range(a - 1, len(arr) - 1):
            key = _key(arr[end - a + 1 : end + 1])
            entries = self._anchors.get(key)
            if entries is None:
                continue
            packed = doc << _END_BITS | end
            if packed in entries:
                entries.remove(packed)
            if not entries:
                del self._anchors[key]

    def match(self, context: Sequence[int], max_match: int = 32) -> tuple[int, list[tuple[int, int]]]:
        """(L, occurrences): the longest suffix of ``context`` (min_match..max_match tokens) that occurred
        followed by a token, and the (doc, end) positions where it ends, newest first; (0, []) if none."""
        a, n = self.min_match, len(context)
        entries = self._anchors.get(_key(context[-a:])) if n >= a else None
        if not entries:
            return 0, []
        best, hits = 0, []
        for packed in reversed(entries):
            doc, end = packed >> _END_BITS, packed & ((1 << _END_BITS) - 1)
            arr = self._docs[doc]
            m, limit = a, min(max_match, end + 1, n)
            while m < limit and arr[end - m] == context[n - 1 - m]:
                m += 1
            if m > best:
                best, hits = m, [(doc, end)]
            elif m == best:
                hits.append((doc, end))
        return best, hits

    def candidates(
        self, context: Sequence[int], depth: int, rows: int, min_prob: float = 0.1, max_match: int = 32
    ) -> Candidates:
        """The draft tree after ``context`` (module docstring): at most ``rows`` nodes, ``depth`` levels."""
        if depth <= 0 or rows <= 0:
            return Candidates()
        match_len, hits = self.match(context, max_match)
        if not hits:
            return Candidates()
        tokens: list[int] = []
        counts: list[int] = []
        kids: dict[int, dict[int, int]] = {ROOT: {}}
        for doc, end in hits:
            arr = self._docs[doc]
            node = ROOT
            for tok in arr[end + 1 : end + 1 + depth]:
                child = kids[node].get(tok)
                if child is None:
                    child = kids[node][tok] = len(tokens)
                    tokens.append(tok)
                    counts.append(0)
                    kids[child] = {}
                counts[child] += 1
                node = child
            self._docs.move_to_end(doc)
        return _best_first(tokens, counts, kids, len(hits), rows, min_prob, match_len)

    def save(self, path: str | Path) -> None:
        """Writes the documents (not the anchors: ``load`` rebuilds them) to ``path``, atomically."""
        docs = list(self._docs.values())
        flat = np.concatenate([np.frombuffer(d, dtype=np.int32) for d in docs]) if docs else np.zeros(0, np.int32)
        buf = io.BytesIO()
        meta = json.dumps({"format": "pie-suffix-index", "version": 1, "min_match": self.min_match})
        np.savez(buf, tokens=flat, lengths=np.array([len(d) for d in docs], dtype=np.int64), meta=np.array(meta))
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(buf.getvalue())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, min_match: int | None = None, max_tokens: int | None = None) -> SuffixIndex:
        """The index saved at ``path``, its anchors rebuilt for ``min_match`` (default: the saved one); with
        ``max_tokens``, documents past the bound are evicted oldest first as they load."""
        with np.load(Path(path), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != "pie-suffix-index":
                raise ValueError(f"{path} is not a suffix index (no pie-suffix-index header)")
            flat, lengths = z["tokens"], z["lengths"]
        index = cls(min_match or int(meta["min_match"]), max_tokens)
        start = 0
        for n in lengths.tolist():
            index.add(flat[start : start + n].tolist())
            start += n
        return index


def _key(tokens: Sequence[int]) -> int:
    """An anchor's tokens packed in one int (32 bits each): a dict key a third the size of a tuple's."""
    key = 0
    for tok in tokens:
        key = key << _END_BITS | tok
    return key


def _best_first(
    tokens: list[int],
    counts: list[int],
    kids: dict[int, dict[int, int]],
    total: int,
    rows: int,
    min_prob: float,
    match_len: int,
) -> Candidates:
    """Takes trie nodes by probability, highest first (a parent's is never below its child's, and a child is
    queued only once its parent is taken, so the order is topological), while prob >= min_prob."""
    out = Candidates(match_len=match_len, occurrences=total)
    new = {ROOT: ROOT}
    heap = [(-counts[c] / total, c, ROOT) for c in kids[ROOT].values()]
    heapq.heapify(heap)
    while heap and len(out.tree) < rows:
        neg, node, parent = heapq.heappop(heap)
        if -neg < min_prob:
            break
        new[node] = out.tree.add(new[parent], tokens[node])
        out.probs.append(-neg)
        for c in kids[node].values():
            heapq.heappush(heap, (-counts[c] / total, c, node))
    return out


def read_corpus(path: Path) -> list[str]:
    """A corpus's documents: a .jsonl's lines ("text" of an object, or a string), else paragraphs of text."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        docs = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [d["text"] if isinstance(d, dict) else str(d) for d in docs]
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def build(corpus: Path, out: Path, tokenizer_json: Path, min_match: int = 2) -> SuffixIndex:
    """Tokenizes ``corpus`` (``read_corpus``) with ``tokenizer_json`` into a new index saved at ``out``."""
    from ..tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_json.read_text(), [], None, None)
    index = SuffixIndex(min_match)
    for text in read_corpus(corpus):
        index.add(tok.encode(text))
    index.save(out)
    return index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m inferlet.spec.suffix_index", description="Build a static suffix index.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="tokenize a corpus into an index file (--suffix-index of the inferlet)")
    b.add_argument("corpus", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--tokenizer", type=Path, required=True, help="the model's tokenizer.json (in its store folder)")
    b.add_argument("--min-match", type=int, default=2)
    a = p.parse_args(argv)
    index = build(a.corpus, a.out, a.tokenizer, a.min_match)
    print(json.dumps({"out": str(a.out), "documents": len(index), "tokens": index.tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
