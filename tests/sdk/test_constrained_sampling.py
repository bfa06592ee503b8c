"""Speculative sampling under a grammar mask keeps plain masked sampling's distribution, for chains (point-mass
drafts, as the constrained inferlet's lookup and forced tokens, and drafts sampled from a drafter's own masked
distribution) and for token trees (children drawn without replacement, recursive rejection); and a rule that
skips the mask's renormalisation fails the same check, so the check has teeth.

What runs is the SDK's own code: ``grammar.Constraint`` (llguidance over the default model's real tokenizer:
``masks`` for a chain window, ``tree_masks`` for a tree window, ``legal_prefix``, ``consume``),
``speculative.filter_distribution`` with the row's mask (the reference the engine's sampler implements),
``speculative.verify_sampled`` and ``tree.verify_tree_sampled`` / ``draw_without_replacement``. Only the model
is replaced: a seeded random-logits function of the prefix (what a random-weight model is, without its cost),
so 2,500 seeded generations per case take a few seconds; a real model's logits would only change which numbers
the same rule is fed. Its logits favour the tokens the grammar ever allows (+BOOST), so under a mask the
allowed tokens hold most but not all of the unmasked mass (the case where skipping renormalisation is subtle).

The grammar ``(cat|dog|bird)`` is small enough to enumerate: every token sequence it allows (any tokenization,
then EOS) and its exact probability under plain masked sampling, a product of the masked rows. Each case draws
TRIALS generations and compares their counts with that law: chi-square at ALPHA (bins of expected count under 5
pooled) and total variation under TV_BOUND.
"""

from __future__ import annotations

import json
import math
import zlib
from collections import Counter
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from inferlet.spec.distribution import filter_distribution
from inferlet.spec.token_tree import ROOT, TokenTree, draw_without_replacement, verify_tree_sampled
from inferlet.spec.verify import verify_sampled
from inferlet.text.grammar import Constraint, grammar_text
from inferlet.tokenizer import Tokenizer
from pie_runtime.store import DEFAULT_MODEL, ModelStore

GRAMMAR = r"(cat|dog|bird)"
TEMPERATURE = 1.0
BOOST = 10.0  # logit added to the tokens the grammar ever allows
TRIALS = 2_500
ALPHA = 1e-4
TV_BOUND = 0.05  # sampling noise at 2,500 draws over 9 outcomes is ~0.02
MAX_LEN = 8


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    folder = Path(ModelStore().path(DEFAULT_MODEL))
    cfg = json.loads((folder / "manifest.json").read_text())["config"]
    return Tokenizer((folder / "tokenizer.json").read_text(), cfg["eos_token_ids"], cfg["bos_token_id"], None)


@pytest.fixture(scope="module")
def world(tok: Tokenizer) -> World:
    return World(tok)


def allowed_of(mask_row: np.ndarray, vocab: int) -> np.ndarray:
    """A packed mask row (int32 words, bit i of word j = token 32 j + i) as a (vocab,) bool array."""
    return np.unpackbits(mask_row.astype("<i4").view(np.uint8), bitorder="little")[:vocab].astype(bool)


class World:
    """The grammar, the random-logits target and drafter, and the exact law of plain masked sampling."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.vocab = tok.vocab_size
        self.grammar = grammar_text(regex=GRAMMAR)
        self.eos = tok.eos_token_ids[0]
        self.boost = np.zeros(self.vocab)
        self.law: dict[tuple[int, ...], float] = {}
        self._enumerate(self.constraint(), [], 1.0, collect=True)
        self.boost[list({t for seq in self.law for t in seq} | {self.eos})] = BOOST
        self.law = {}
        self._enumerate(self.constraint(), [], 1.0, collect=False)

    def constraint(self) -> Constraint:
        """The grammar's constraint at its start (one matcher, reset: building one per generation is slow)."""
        if not hasattr(self, "_constraint"):
            self._constraint = Constraint(self.tok, self.vocab, self.grammar)
        self._constraint.matcher.reset()
        return self._constraint

    @cache  # noqa: B019 - the world lives for the module
    def logits(self, prefix: tuple[int, ...], seed: int) -> np.ndarray:
        rng = np.random.default_rng([seed, zlib.crc32(np.asarray(prefix, dtype=np.int64).tobytes())])
        return rng.normal(0.0, 1.5, self.vocab) + self.boost

    def row(self, prefix: tuple[int, ...], mask_row: np.ndarray, renormalize: bool = True, seed: int = 0):
        """The target's (seed 0) or the drafter's (seed 1) distribution after ``prefix`` under the mask:
        renormalized over the allowed tokens (the SDK's rule), or the unmasked one with the refused tokens
        zeroed and NOT renormalized (the broken variant)."""
        return self._row(prefix, mask_row.tobytes(), renormalize, seed)

    @cache  # noqa: B019 - a pure function of its arguments, memoized for speed
    def _row(self, prefix: tuple[int, ...], mask: bytes, renormalize: bool, seed: int) -> np.ndarray:
        allowed = allowed_of(np.frombuffer(mask, dtype=np.int32), self.vocab)
        x = self.logits(prefix, seed)
        if renormalize:
            return filter_distribution(x, TEMPERATURE, mask=allowed)
        return filter_distribution(x, TEMPERATURE) * allowed

    def _enumerate(self, c: Constraint, prefix: list[int], prob: float, collect: bool) -> None:
        """Every sequence the grammar allows from here and its probability under plain masked sampling."""
        mask = c.masks([])[0]
        p = self.row(tuple(prefix), mask) if not collect else allowed_of(mask, self.vocab).astype(float)
        for t in np.flatnonzero(p > 0).tolist():
            if t == self.eos:
                self.law[tuple(prefix)] = prob * (p[t] if not collect else 1.0)
                continue
            assert len(prefix) < MAX_LEN, "the grammar is too large to enumerate"
            c.consume([t])
            self._enumerate(c, [*prefix, t], prob * (p[t] if not collect else 1.0), collect)
            c.matcher.rollback(1)


# ---- one generation under each rule ----------------------------------------------------------------------------


def finish(out: list[int], tokens: list[int], eos: int) -> bool:
    """Appends the round's tokens up to EOS; True when EOS ended the output."""
    for t in tokens:
        if t == eos:
            return True
        out.append(t)
    return False


def chain_generation(w: World, rng: np.random.Generator, renormalize: bool, point_mass: bool) -> tuple[int, ...]:
    """One output: rounds of up to 2 drafts (point mass: a lookup guess, " dog"'s tokens, cut where the grammar
    refuses; else each drawn from the drafter's masked distribution), verified by ``verify_sampled``."""
    c, out, guess = w.constraint(), [], w.tok.encode("dog")
    while len(out) < MAX_LEN:
        if point_mass:
            drafts, q = c.legal_prefix(guess[len(out) :][:2] if guess[: len(out)] == out else []), None
        else:
            drafts, qs = [], []
            for _ in range(2):
                row = w.row(tuple(out + drafts), c.masks(drafts)[-1], seed=1).copy()
                row[w.eos] = 0.0  # EOS ends an output: the drafter does not draft it
                if not row.sum() > 0:
                    break
                qs.append(row / row.sum())
                drafts += draw_without_replacement(qs[-1], 1, rng)
            q = np.stack(qs) if qs else None
        masks = c.masks(drafts)
        p = np.stack([w.row(tuple(out + drafts[:i]), masks[i], renormalize) for i in range(len(drafts) + 1)])
        tokens = verify_sampled(drafts, p, q, rng).tokens
        if finish(out, tokens, w.eos):
            break
        c.consume(tokens)
    return tuple(out)


def draft_tree(w: World, c: Constraint, out: list[int], rng: np.random.Generator) -> TokenTree:
    """Two children drawn without replacement from the drafter's masked distribution (EOS aside), each with
    one child drawn the same way: the q each node's children came from kept in ``child_q``."""
    tree = TokenTree()

    def q_after(path: list[int]) -> np.ndarray | None:
        row = w.row(tuple(out + path), c.masks(path)[-1], seed=1).copy()
        row[w.eos] = 0.0
        return row / row.sum() if row.sum() > 0 else None

    q0 = q_after([])
    if q0 is None:
        return tree
    tree.child_q[ROOT] = q0
    for t in draw_without_replacement(q0, 2, rng):
        node = tree.add(ROOT, t)
        q1 = q_after([t])
        if q1 is not None:
            tree.child_q[node] = q1
            tree.add(node, draw_without_replacement(q1, 1, rng)[0])
    return tree


def tree_generation(w: World, rng: np.random.Generator, renormalize: bool) -> tuple[int, ...]:
    """One output: rounds of a drafted token tree under ``tree_masks``, verified by ``verify_tree_sampled``."""
    c, out = w.constraint(), []
    while len(out) < MAX_LEN:
        tree = draft_tree(w, c, out, rng)
        masks = c.tree_masks(tree)
        paths = [[]] + [path_of(tree, n) for n in range(len(tree))]
        p = np.stack([w.row(tuple(out + path), masks[r], renormalize) for r, path in enumerate(paths)])
        tokens = verify_tree_sampled(tree, p, rng).tokens
        if finish(out, tokens, w.eos):
            break
        c.consume(tokens)
    return tuple(out)


def path_of(tree: TokenTree, node: int) -> list[int]:
    path = []
    while node != ROOT:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


# ---- the check ----------------------------------------------------------------------------------------------


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """The chi-square quantile by Wilson and Hilferty's cube-root normal approximation (within 1% for df >= 3
    at these tails), with the normal quantile found by bisection on erfc."""
    lo, hi = 0.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * math.erfc(mid / math.sqrt(2)) > alpha else (lo, mid)
    z, h = hi, 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def mismatch(counts: Counter, law: dict[tuple[int, ...], float]) -> str | None:
    """Why the counts do not fit the law (chi-square at ALPHA, TV under TV_BOUND), or None if they do."""
    n = sum(counts.values())
    if set(counts) - set(law):
        return f"outputs the grammar does not allow: {set(counts) - set(law)}"
    bins: list[tuple[float, float]] = []  # (observed, expected)
    pooled = [0.0, 0.0]
    for seq, prob in law.items():
        o, e = counts.get(seq, 0), n * prob
        if e < 5:
            pooled[0] += o
            pooled[1] += e
        else:
            bins.append((o, e))
    if pooled[1] > 0:
        bins.append((pooled[0], pooled[1]))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    tv = 0.5 * sum(abs(counts.get(seq, 0) / n - prob) for seq, prob in law.items())
    crit = chi2_critical(len(bins) - 1)
    if stat >= crit or tv >= TV_BOUND:
        return f"chi2 {stat:.1f} (critical {crit:.1f}, {len(bins)} bins), TV {tv:.4f}"
    return None


def draw(generate: Callable[[np.random.Generator], tuple[int, ...]], seed: int) -> Counter:
    rng = np.random.default_rng(seed)
    return Counter(generate(rng) for _ in range(TRIALS))


# ---- the tests --------------------------------------------------------------------------------------------------


def test_the_grammar_is_small_and_the_law_exact(world):
    assert 3 <= len(world.law) <= 64, len(world.law)
    assert sum(world.law.values()) == pytest.approx(1.0, abs=1e-9)
    texts = {world.tok.decode(list(seq)) for seq in world.law}
    assert texts == {"cat", "dog", "bird"}
    assert any(len(seq) >= 2 for seq in world.law)  # outputs of 2-3 tokens, not just one


@pytest.mark.parametrize("point_mass", [True, False], ids=["point-mass", "sampled-q"])
def test_masked_speculative_chain_keeps_the_distribution(world, point_mass):
    counts = draw(lambda rng: chain_generation(world, rng, True, point_mass), seed=1 + point_mass)
    assert mismatch(counts, world.law) is None, mismatch(counts, world.law)


@pytest.mark.parametrize("point_mass", [True, False], ids=["point-mass", "sampled-q"])
def test_a_chain_rule_without_renormalisation_fails(world, point_mass):
    counts = draw(lambda rng: chain_generation(world, rng, False, point_mass), seed=3 + point_mass)
    assert mismatch(counts, world.law) is not None


def test_masked_speculative_tree_keeps_the_distribution(world):
    counts = draw(lambda rng: tree_generation(world, rng, True), seed=5)
    assert mismatch(counts, world.law) is None, mismatch(counts, world.law)


def test_a_tree_rule_without_renormalisation_fails(world):
    counts = draw(lambda rng: tree_generation(world, rng, False), seed=6)
    assert mismatch(counts, world.law) is not None
