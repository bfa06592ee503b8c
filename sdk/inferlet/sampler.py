"""How a run picks its tokens: the ``Verifier`` (the readout a round reads on its verify rows and the rule that
keeps drafts, inferlet.speculative) and, for the fallback that reads every step's logits, the ``PlainSampler``
(penalties, logit bias, logprobs)."""

from __future__ import annotations

import numpy as np

from .args import DecodeArgs
from .forward import ReadoutResult
from .readouts import Argmax, Distribution
from .speculative import VerifyResult, filter_distribution, verify_greedy, verify_sampled


def draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn proportionally to non-negative ``weights``."""
    return verify_sampled([], np.asarray(weights, dtype=np.float64)[None], None, rng).tokens[0]


class Verifier:
    """Readout kind and verification rule of a run: Argmax + verify_greedy at temperature 0, else
    Distribution (same temperature/top-k/top-p) + verify_sampled with the run's seeded generator."""

    def __init__(self, args: DecodeArgs):
        self.args = args
        self.greedy = args.temperature == 0
        self.rng = np.random.default_rng(args.seed)

    def kind(self) -> Argmax | Distribution:
        a = self.args
        return Argmax() if self.greedy else Distribution(a.temperature, a.top_k, a.top_p)

    def verify(self, drafts: list[int], readout: ReadoutResult, q: np.ndarray | None = None) -> VerifyResult:
        if self.greedy:  # Argmax tokens (R,), or MTP tokens (R, 1+k) whose column 0 is the argmax
            tokens = readout.tokens
            assert tokens is not None, f"a greedy run verifies Argmax or MTP tokens, not {readout.kind}"
            return verify_greedy(drafts, tokens[:, 0] if tokens.ndim == 2 else tokens)
        assert readout.probs is not None, f"a sampled run verifies a Distribution, not {readout.kind}"
        return verify_sampled(drafts, readout.probs, q, self.rng)


class PlainSampler:
    """The fallback's sampler over raw logits: penalties and logit bias, logprobs, then greedy or a seeded draw
    from ``filter_distribution``. Logprobs are those of the adjusted logits, before temperature."""

    def __init__(self, args: DecodeArgs, prompt: list[int], rng: np.random.Generator):
        self.args = args
        self.rng = rng
        self.prompt = np.unique(np.asarray(prompt, dtype=np.int64))
        self.logprobs: list[dict] = []

    def adjust(self, logits: np.ndarray, generated: list[int]) -> np.ndarray:
        a = self.args
        x = np.array(logits, dtype=np.float64)
        for tok_id, bias in a.logit_bias.items():
            x[int(tok_id)] += bias
        counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=x.shape[0])[: x.shape[0]]
        x -= a.frequency_penalty * counts + a.presence_penalty * (counts > 0)
        if a.repetition_penalty not in (0.0, 1.0):
            seen = np.union1d(self.prompt, np.flatnonzero(counts))
            v = x[seen]
            x[seen] = np.where(v > 0, v / a.repetition_penalty, v * a.repetition_penalty)
        return x

    def choose(self, logits: np.ndarray, generated: list[int]) -> int:
        x = self.adjust(logits, generated)
        a = self.args
        if a.temperature == 0:
            token = int(np.argmax(x))
        else:
            token = draw(filter_distribution(x, a.temperature, a.top_k, a.top_p), self.rng)
        if a.logprobs is not None:
            finite = np.isfinite(x)
            m = x[finite].max()
            lp = np.where(finite, x - m - np.log(np.exp(x[finite] - m).sum()), -np.inf)
            top = np.argsort(-lp, kind="stable")[: a.logprobs]
            self.logprobs.append(
                {"token": token, "logprob": float(lp[token]), "top": [[int(t), float(lp[t])] for t in top]}
            )
        return token
