"""Shared decode loop of the speculative inferlets: arguments, output cutting, the fallback sampler, stats.

One round (DESIGN §5):

    drafts = drafter.propose(seq, k)                     # may be [] → a plain step, window [last]
    res = fire([last] + drafts, readout on every row, fold=DEFERRED)
    v = verify(drafts, res)                              # accepted drafts + one target token
    ws.settle(1 + v.accepted)                            # commit `last` and the accepted drafts only,
                                                         # carried by the next fire (no extra message)
    output.push(v.tokens)                                # cut at EOS / stop string / token limit

Terms:
    room          tokens the output may still take (max_tokens minus those emitted);
    plain step    a round without drafts; its reason is counted in ``stats.skipped`` (``no_draft``: the
                  drafter had none; ``draft_cost``: the draft-length planner expected drafting to be slower);
    fallback      a run that never speculates because its sampler needs every step's logits
                  (penalties, a logit bias, logprobs): it reads Logits and samples here.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
from pydantic import field_validator

from .args import CompletionArgs
from .draft_length import DraftPlanner
from .forward import DEFERRED, ForwardPass, PassResult, ReadoutResult
from .model import Model
from .readouts import Argmax, Distribution, Logits, ReadoutKind
from .runtime import emit, inferlet_name
from .speculative import SpecStats, VerifyResult, filter_distribution, verify_greedy, verify_sampled
from .tokenizer import StreamDecoder, Tokenizer


class DecodeArgs(CompletionArgs):
    """text-completion's arguments plus the sampler options that turn speculation off."""

    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # Hugging Face's: logits of seen tokens (prompt too) / r if > 0 else * r
    logit_bias: dict[int, float] = {}  # token id → added to its logit; JSON text on the command line
    logprobs: int | None = None  # record each token's logprob and this many top alternatives (bare flag: 0)
    timing: bool = False  # per-round times in stats
    # adaptive: each round drafts the count with the most expected tokens per ms (inferlet.draft_length),
    # at most the inferlet's draft length; fixed: always the draft length
    draft_schedule: Literal["adaptive", "fixed"] = "adaptive"

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _json_bias(cls, v):
        return json.loads(v) if isinstance(v, str) else v

    @field_validator("logprobs", mode="before")
    @classmethod
    def _bare_logprobs(cls, v):
        return {True: 0, False: None}.get(v, v) if isinstance(v, bool) else v

    def fallback_reasons(self) -> list[str]:
        """Why this run may not speculate; [] when it may."""
        reasons = []
        if self.presence_penalty or self.frequency_penalty or self.repetition_penalty not in (0.0, 1.0):
            reasons.append("penalties")
        if self.logit_bias:
            reasons.append("logit_bias")
        if self.logprobs is not None:
            reasons.append("logprobs")
        return reasons


def prompt_ids(tok: Tokenizer, args: DecodeArgs) -> list[int]:
    text = tok.chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    return tok.encode(text)


class Output:
    """The tokens a run returns, cut exactly where text-completion stops: at the first EOS (not kept), a
    stop string (the token that completes it is kept, the text is cut before it), max_tokens, or when the
    sequence reaches the model's capacity."""

    def __init__(self, tok: Tokenizer, args: DecodeArgs, prompt_len: int, max_positions: int):
        self.args = args
        self.eos = set(tok.eos_token_ids)
        self.stream = StreamDecoder(tok)
        self.capacity = max_positions - prompt_len  # text-completion stops when prompt + out reaches it
        self.ids: list[int] = []
        self.finish: str | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def room(self) -> int:
        return self.args.max_tokens - len(self.ids)

    def push(self, tokens: list[int]) -> int:
        """Appends tokens until the output ends; returns how many it took (EOS counts as taken)."""
        for n, t in enumerate(tokens, 1):
            t = int(t)
            if t in self.eos:
                self.finish = "eos"
                return n
            self.ids.append(t)
            delta = self.stream.push([t])
            if self.args.stop and any(s in self.stream.text for s in self.args.stop):
                self.finish = "stop"
                return n
            if self.args.stream and delta:
                emit(delta)
            if len(self.ids) >= self.args.max_tokens or len(self.ids) >= self.capacity:
                self.finish = "length"
                return n
        return len(tokens)

    def text(self) -> str:
        text = self.stream.tokenizer.decode(self.ids)
        if self.finish == "stop":
            text = text[: min(text.find(s) for s in self.args.stop if s in text)]
        return text


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

    def kind(self):
        a = self.args
        return Argmax() if self.greedy else Distribution(a.temperature, a.top_k, a.top_p)

    def verify(self, drafts: list[int], readout: ReadoutResult, q: np.ndarray | None = None) -> VerifyResult:
        if self.greedy:  # Argmax tokens (R,), or MTP tokens (R, 1+k) whose column 0 is the argmax
            tokens = readout.tokens
            return verify_greedy(drafts, tokens[:, 0] if tokens.ndim == 2 else tokens)
        return verify_sampled(drafts, readout.probs, q, self.rng)


class PlainSampler:
    """The fallback's sampler over raw logits: penalties and logit bias, logprobs, then greedy or a seeded draw
    from ``filter_distribution``. Logprobs are those of the adjusted logits, before temperature."""

    def __init__(self, args: DecodeArgs, prompt: list[int], rng: np.random.Generator):
        self.args = args
        self.rng = rng
        self.seen = np.zeros(0, dtype=np.int64)  # counts of generated tokens (grown on demand)
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
            self.logprobs.append({"token": token, "logprob": float(lp[token]),
                                  "top": [[int(t), float(lp[t])] for t in top]})
        return token


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    q: np.ndarray | None = None  # (len(tokens), V) drafter probabilities; None for point-mass drafts


class Drafter:
    """What a speculative inferlet plugs into `speculate`. The defaults draft nothing."""

    draft_cost_ms: float = 0.0  # what proposing one more draft costs (a draft model's step); 0 for lookups
    planner: DraftPlanner | None = None  # the run's draft-length planner, set by the round loop

    async def prefill(self, prompt: list[int]) -> None:
        """Runs alongside the target's prefill (a draft model prefills its own working set here)."""

    async def propose(self, seq: list[int], k: int) -> Proposal:
        """Up to k drafts to follow ``seq`` (prompt and output so far; its last token is not yet in the cache)."""
        return Proposal()

    def masks(self, drafts: list[int]) -> np.ndarray | None:
        """(len(drafts)+1, ceil(V/32)) int32 masks of the verify rows, or None for no constraint."""
        return None

    def readouts(self, verifier: Verifier) -> list[ReadoutKind]:
        """Readouts on every row of a fire; the first is verified (Argmax, Distribution, or MTP when greedy)."""
        return [verifier.kind()]

    def observe(self, res: PassResult, verified: VerifyResult) -> None:
        """Sees each fire's readouts and verdict (an MTP drafter keeps the next round's drafts from them)."""

    async def commit(self, new_tokens: list[int], seq: list[int], committed: int) -> None:
        """After each step: the tokens it emitted, the sequence now, the target's committed rows."""

    async def close(self) -> None:
        pass


@dataclass
class Run:
    """The state of one speculative run, and the result it builds."""

    model: Model
    args: DecodeArgs
    prompt: list[int]
    out: Output
    stats: SpecStats = field(default_factory=SpecStats)
    prefill_ms: float = 0.0
    decode_s: float = 0.0
    round_ms: list[float] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)
    logprobs: list[dict] | None = None

    async def finish(self) -> dict:
        """Reports the run's counters to the engine (summed in its ``stats``), then returns the result."""
        await self.model.client.request(
            "spec_report", model=self.model.name, inferlet=inferlet_name(), **asdict(self.stats),
            decode_tokens=max(len(self.out.ids) - 1, 0), decode_s=self.decode_s, prefill_ms=self.prefill_ms)
        return self.result()

    def result(self) -> dict:
        decoded = max(len(self.out.ids) - 1, 0)  # the first token came with the prefill
        rate = round(decoded / self.decode_s, 2) if self.decode_s > 0 and decoded else 0.0
        stats = {"prompt_tokens": len(self.prompt), "generated_tokens": len(self.out.ids),
                 **self.stats.as_dict(rate, round(self.prefill_ms, 2))}
        if self.args.timing:
            stats["round_ms"] = [round(t, 3) for t in self.round_ms]
            stats["draft_ms"] = [round(t, 3) for t in self.draft_ms]
        res = {"text": self.out.text(), "token_ids": self.out.ids, "finish_reason": self.out.finish or "length",
               "stats": stats}
        if self.logprobs is not None:
            res["logprobs"] = self.logprobs
        return res


async def drive_rounds(model: Model, run: Run, ws, drafter: Drafter, k: int, step, fallback: list[str]) -> None:
    """The round loop shared by every way of verifying: prefill, then per round choose the drafts (or say in
    ``stats.skipped`` why there are none) and ``await step(window, drafts, q)`` for the emitted tokens, until the
    output is done. ``fallback`` (reasons a run never speculates) makes every round a plain step.
    Up to ``k`` drafts a round: with ``draft_schedule=adaptive`` the planner's count for this round.
    Records prefill and decode times, and releases the working set and the drafter at the end."""
    out, stats = run.out, run.stats
    costs = model.pass_cost_ms if run.args.draft_schedule == "adaptive" else []
    planner = drafter.planner = DraftPlanner(k, costs, drafter.draft_cost_ms)
    prompt = list(run.prompt)
    seq = list(prompt)
    try:
        t0 = time.perf_counter()
        prefill = [step(prompt, [], None)] + ([] if fallback else [drafter.prefill(prompt)])
        first, *_ = await asyncio.gather(*prefill)
        run.prefill_ms = (time.perf_counter() - t0) * 1e3
        run.round_ms.clear()
        t_decode = time.perf_counter()
        new = first
        while True:
            taken = new[: out.push(new)]
            seq += taken
            await drafter.commit(taken, seq, ws.committed)
            if out.done:
                break
            proposal = Proposal()
            if fallback:
                for reason in fallback:
                    stats.skip(reason)
            elif out.room <= 1:
                stats.skip("last_token")  # only the bonus token is left to emit
            elif ws.committed + 1 + k > model.max_positions:
                stats.skip("near_capacity")  # a full verify window would not fit
            elif (want := planner.next()) == 0 and k > 0:
                stats.skip("draft_cost")  # the planner expects a plain step to be faster at this acceptance
            else:
                t = time.perf_counter()
                proposal = await drafter.propose(seq, min(want, out.room - 1))
                run.draft_ms.append((time.perf_counter() - t) * 1e3)
                if not proposal.tokens:
                    stats.skip("no_draft")
            new = await step([seq[-1]] + proposal.tokens, proposal.tokens, proposal.q)
            planner.observe(len(proposal.tokens), len(new) - 1)
        run.decode_s = time.perf_counter() - t_decode
    finally:
        await drafter.close()
        await ws.release()


async def speculate(model: Model, args: DecodeArgs, drafter: Drafter, k: int,
                    verifier: Verifier | None = None) -> dict:
    """Runs the round loop (module docstring) with up to ``k`` drafts a round; returns the inferlet result.
    Pass ``verifier`` when the drafter samples too, so both draw from one seeded generator."""
    tok = model.tokenizer
    prompt = prompt_ids(tok, args)
    run = Run(model, args, prompt, Output(tok, args, len(prompt), model.max_positions))
    out, stats = run.out, run.stats
    verifier = verifier or Verifier(args)
    fallback = args.fallback_reasons()
    plain = PlainSampler(args, prompt, verifier.rng) if fallback else None
    ws = model.working_set()

    async def step(window: list[int], drafts: list[int], q) -> list[int]:
        """One fire over ``window`` (whose last len(drafts) rows are the drafts); returns the emitted tokens."""
        rows = list(range(len(window) - len(drafts) - 1, len(window)))
        fp = ForwardPass(ws).embed(window)
        masks = drafter.masks(drafts)
        for kind in [Logits()] if plain is not None else drafter.readouts(verifier):
            fp.readout(rows, kind, masks)
        fp.fold(DEFERRED if drafts else len(window))
        t0 = time.perf_counter()
        res = await fp.submit()
        run.round_ms.append((time.perf_counter() - t0) * 1e3)
        if plain is not None:
            return [plain.choose(res.logits[0], out.ids)]
        v = verifier.verify(drafts, res.readouts[0], q)
        drafter.observe(res, v)
        if drafts:
            stats.record(v)
            ws.settle(len(window) - len(drafts) + v.accepted)
        return v.tokens

    await drive_rounds(model, run, ws, drafter, k, step, fallback)
    if plain is not None and args.logprobs is not None:
        run.logprobs = plain.logprobs
    return await run.finish()
