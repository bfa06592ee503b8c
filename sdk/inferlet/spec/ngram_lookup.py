"""Prompt lookup ("cacheback") drafting: guess the continuation from the text already seen.

Saxena 2023, "Prompt Lookup Decoding". The drafter is a point mass (see `inferlet.spec.verify`):

    for n in max_ngram down to min_ngram:
        find the most recent earlier occurrence of the last n tokens (not the suffix itself)
        if found: return the up to k tokens that followed it
    return []

`lookup_drafts` searches the whole sequence each call (numpy, O(len * max_ngram)); `NgramIndex`
keeps a hash of every n-gram's most recent positions and answers in O(max_ngram) per round, for
long generations. Both return the same drafts.

For a token tree (inferlet.spec.token_tree), `NgramIndex.draft_paths` returns the continuations of several earlier
occurrences, best first: the longest matching n first, the most recent occurrence first within an n.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

MAX_OCCURRENCES = 8  # earlier occurrences an n-gram keeps (the most recent ones), for a tree's branches


def _check(max_ngram: int, min_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")


def lookup_drafts(tokens: Sequence[int], max_ngram: int, min_ngram: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens,
    for the largest n in [min_ngram, max_ngram] that has one; [] when none does."""
    _check(max_ngram, min_ngram)
    arr = np.asarray(tokens, dtype=np.int64)
    n_tokens = arr.shape[0]
    if k <= 0 or n_tokens < min_ngram + 1:
        return []
    # Candidates are end positions e < n_tokens-1 of an earlier n-gram; match[j] counts how many
    # tokens ending at cand[j] agree with the suffix, read backwards, capped at max_ngram.
    cand = np.flatnonzero(arr[:-1] == arr[-1])
    match = np.ones(cand.shape[0], dtype=np.int64)
    alive = np.ones(cand.shape[0], dtype=bool)
    for t in range(1, min(max_ngram, n_tokens)):
        pos = cand - t
        ok = alive & (pos >= 0)
        ok[ok] = arr[pos[ok]] == arr[n_tokens - 1 - t]
        match += ok
        alive = ok
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        hits = cand[match >= n]
        if hits.size:
            e = int(hits[-1])
            return arr[e + 1 : e + 1 + k].tolist()
    return []


class NgramIndex:
    """Incremental prompt-lookup drafter: `extend` with committed tokens, `draft(k)` each round."""

    def __init__(self, max_ngram: int, min_ngram: int, tokens: Iterable[int] = ()) -> None:
        _check(max_ngram, min_ngram)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        # n-gram tuple -> end positions of its most recent occurrences that have a following token (last: newest).
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        toks = self.tokens
        for tok in tokens:
            # The n-grams ending at the current last token gain a continuation now, so they
            # become lookup targets; the suffix itself is never indexed before this point.
            end = len(toks) - 1
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                ends = self._ends.setdefault(tuple(toks[end - n + 1 : end + 1]), [])
                ends.append(end)
                if len(ends) > MAX_OCCURRENCES:
                    del ends[0]
            toks.append(int(tok))

    def draft(self, k: int) -> list[int]:
        paths = self.draft_paths(k, 1)
        return paths[0] if paths else []

    def draft_paths(self, k: int, count: int) -> list[list[int]]:
        """Up to ``count`` distinct continuations of up to ``k`` tokens, best first (module docstring)."""
        toks = self.tokens
        if k <= 0 or count <= 0:
            return []
        out: list[list[int]] = []
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            for end in reversed(self._ends.get(tuple(toks[-n:]), [])):
                path = toks[end + 1 : end + 1 + k]
                if path not in out:
                    out.append(path)
                    if len(out) == count:
                        return out
        return out
