"""How a run picks its tokens on the host: for a speculative run's fallback that reads every step's logits, the
``PlainSampler``
(penalties, logit bias, logprobs); and text-completion's ``StepSampler``, which reads the engine's Argmax or
seeded Sample unless the host must pick (PlainSampler), with a Logits readout beside it for logprobs.

A logprobs entry is ``{"token_id", "logprob", "top": [[id, logprob], ...]}``: log-softmax of the step's logits
after the logit bias and penalties, before temperature, top-k and top-p (so at temperature 1 with no bias,
exp(logprob) is the engine's Distribution probability); ``top`` is sorted by logprob, ties to the lower id."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np

from .forward import ForwardPass, PassResult
from .readouts import Argmax, Logits, ReadoutSpec, Sample
from .spec.distribution import filter_distribution
from .spec.verify import verify_sampled
from .text.arguments import CompletionArgs
from .text.output import Output
from .working_set import WorkingSet

Fire = Callable[[WorkingSet, list[int], ForwardPass], Awaitable[PassResult]]  # StepSampler.step's ``fire``


def logprob_entry(logits: np.ndarray, token: int, top: int) -> dict:
    """The logprobs entry of ``token`` (module docstring) from one row of (adjusted) logits."""
    x = np.asarray(logits, dtype=np.float64)
    finite = np.isfinite(x)
    m = x[finite].max()
    lp = np.where(finite, x - m - np.log(np.exp(x[finite] - m).sum()), -np.inf)
    best = np.argsort(-lp, kind="stable")[:top]
    return {"token_id": int(token), "logprob": float(lp[token]), "top": [[int(t), float(lp[t])] for t in best]}


def draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn proportionally to non-negative ``weights``."""
    return verify_sampled([], np.asarray(weights, dtype=np.float64)[None], None, rng).tokens[0]


class PlainSampler:
    """The fallback's sampler over raw logits: penalties and logit bias, logprobs, then greedy or a seeded draw
    from ``filter_distribution``. Logprobs are those of the adjusted logits, before temperature."""

    def __init__(self, args: CompletionArgs, prompt: list[int], rng: np.random.Generator):
        self.args = args
        self.rng = rng
        self.prompt = np.unique(np.asarray(prompt, dtype=np.int64))
        self.logprobs: list[dict] = []

    def adjust(self, logits: np.ndarray, generated: list[int]) -> np.ndarray:
        a = self.args
        x = np.array(logits, dtype=np.float64)
        for tok_id, bias in a.logit_bias.items():
            if not 0 <= tok_id < x.shape[0]:
                raise ValueError(f"logit_bias names token {tok_id}, outside the vocabulary of {x.shape[0]}")
            x[tok_id] += bias
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
        if a.top_count is not None:
            self.logprobs.append(logprob_entry(x, token, a.top_count))
        return token


class StepSampler:
    """How text-completion picks each token of one choice: the engine's Argmax, or its Sample seeded with
    ``seed + step`` (same seed, same tokens), plus a Logits readout on the same row when logprobs are asked
    for; a run with penalties or a logit bias reads only Logits and picks with a ``PlainSampler``."""

    def __init__(self, args: CompletionArgs, prompt: list[int]):
        self.args = args
        self.host = PlainSampler(args, prompt, np.random.default_rng(args.seed)) if args.host_sampling() else None
        self._logprobs: list[dict] = []

    @property
    def logprobs(self) -> list[dict]:
        return self.host.logprobs if self.host is not None else self._logprobs

    def readouts(self, step: int) -> list[ReadoutSpec]:
        """The readouts of the row that picks token ``step`` (0: the prefill's)."""
        a = self.args
        if self.host is not None:
            return [Logits()]
        if a.temperature == 0:
            kinds: list[ReadoutSpec] = [Argmax()]
        else:
            kinds = [Sample(a.temperature, a.top_k, a.top_p, None if a.seed is None else a.seed + step)]
        return kinds + [Logits()] if a.top_count is not None else kinds

    async def step(self, ws: WorkingSet, window: list[int], out: Output, fire: Fire | None = None) -> None:
        """One step of a plain decode: fires ``window`` on ``ws`` with this sampler's readouts on its last row,
        and pushes the token picked to ``out`` (a prefill's window is the prompt, a decode step's the last token).
        ``fire(ws, window, fp)`` submits the pass instead of ``fp.submit()`` (a KV policy adding its own readouts
        after these, and evicting after the pass: inferlets/h2o.py)."""
        fp = ForwardPass(ws).embed(window)
        for kind in self.readouts(len(out.ids)):
            fp.readout([len(window) - 1], kind)
        res = await (fire(ws, window, fp) if fire is not None else fp.submit())
        out.push([self.pick(res, out.ids)])

    def result(self, out: Output, ws: WorkingSet, prompt_tokens: int, decode_s: float, **stats: object) -> dict:
        """A plain decode's result: ``out``'s, with stats (the prompt's and output's tokens, then ``stats``, the
        decode rate and the KV pages ``ws`` held at the end and at most) and the logprobs when asked for."""
        decoded = max(len(out.ids) - 1, 0)  # the first token came with the prefill
        rate = round(decoded / decode_s, 2) if decode_s > 0 and decoded else 0.0
        result = {
            **out.result(),
            "stats": {
                "prompt_tokens": prompt_tokens,
                "generated_tokens": len(out.ids),
                **stats,
                "decode_tokens_per_s": rate,
                "kv_pages": ws.pages,
                "kv_pages_max": ws.pages_max,
                "kv_bytes": ws.kv_bytes,
                "kv_bytes_max": ws.kv_bytes_max,
            },
        }
        if self.args.top_count is not None:
            result["logprobs"] = self.logprobs
        return result

    def pick(self, res: PassResult, generated: list[int]) -> int:
        """The token of a fire read with ``readouts`` (one row), recording its logprobs if asked."""
        first = res.readouts[0]
        if self.host is not None:
            assert first.logits is not None  # the Logits readout
            return self.host.choose(first.logits[0], generated)
        assert first.tokens is not None  # Argmax or Sample
        token = int(first.tokens[0])
        if self.args.top_count is not None:
            logits = res.readouts[1].logits
            assert logits is not None
            self._logprobs.append(logprob_entry(logits[0], token, self.args.top_count))
        return token


def __getattr__(name: str) -> object:
    """``Verifier`` moved to inferlet.spec.verifier; the old name works for one release, with a warning."""
    if name == "Verifier":
        import warnings

        from .spec.verifier import Verifier

        warnings.warn("inferlet.sampler.Verifier moved to inferlet.spec.verifier", DeprecationWarning, stacklevel=2)
        return Verifier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
