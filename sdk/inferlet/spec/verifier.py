"""A run's verification rule (``Verifier``): the readout a round reads on its verify rows and the rule that keeps
drafts (inferlet.spec.verify, inferlet.tree): Argmax + greedy verification at temperature 0, else Distribution
(the run's temperature, top-k, top-p) + speculative sampling with the run's seeded generator."""

from __future__ import annotations

import numpy as np

from ..forward import ReadoutResult
from ..readouts import Argmax, Distribution
from ..text.arguments import CompletionArgs
from .token_tree import TokenTree, TreeVerdict, verify_tree_greedy, verify_tree_sampled
from .verify import VerifyResult, verify_greedy, verify_sampled


class Verifier:
    """Readout kind and verification rule of a run: Argmax + verify_greedy at temperature 0, else
    Distribution (same temperature/top-k/top-p) + verify_sampled with the run's seeded generator."""

    def __init__(self, args: CompletionArgs):
        self.args = args
        self.greedy = args.temperature == 0
        self.rng = np.random.default_rng(args.seed)

    def kind(self) -> Argmax | Distribution:
        a = self.args
        return Argmax() if self.greedy else Distribution(a.temperature, a.top_k, a.top_p)

    def verify(self, drafts: list[int], readout: ReadoutResult, q: np.ndarray | None = None) -> VerifyResult:
        if self.greedy:  # Argmax tokens (R,), or MTP/Eagle tokens (R, 1+k) whose column 0 is the argmax
            tokens = readout.tokens
            assert tokens is not None, f"a greedy run verifies Argmax or MTP tokens, not {readout.kind}"
            return verify_greedy(drafts, tokens[:, 0] if tokens.ndim == 2 else tokens)
        assert readout.probs is not None, f"a sampled run verifies a Distribution, not {readout.kind}"
        return verify_sampled(drafts, readout.probs, q, self.rng)

    def verify_tree(self, tree: TokenTree, readout: ReadoutResult) -> TreeVerdict:
        """``verify`` for a tree window (inferlet.tree): the readout has one row per window row."""
        if self.greedy:
            tokens = readout.tokens
            assert tokens is not None, f"a greedy run verifies Argmax or MTP tokens, not {readout.kind}"
            return verify_tree_greedy(tree, tokens[:, 0] if tokens.ndim == 2 else tokens)
        assert readout.probs is not None, f"a sampled run verifies a Distribution, not {readout.kind}"
        return verify_tree_sampled(tree, readout.probs, self.rng)
