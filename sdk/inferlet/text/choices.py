"""``n`` choices of one prompt (OpenAI's ``n``): one prefill, then a fork of the prompt's working set per
choice, each decoded by the inferlet's own loop, all at once (the engine batches their steps).

    base = fire(prompt[:-1], fold all)              # the shared prefill, no readout
    forks = [base] + [base.fork() for 1..n-1]       # copy-on-write: the prompt's pages are shared
    results = gather(loop(args.for_choice(i), forks[i]))   # each loop embeds prompt[ws.committed:] = [last]
    result = choice 0's fields + choices [{text, token_ids, finish_reason, stop_reason[, logprobs]}]

Each choice reads its first token from its own one-row fire, so the choices differ as soon as they sample;
choice i > 0 draws from a seed derived from ``seed`` (``CompletionArgs.for_choice``). With ``n == 1`` the loop
runs on a fresh working set and prefills the whole prompt itself, exactly as without this module.

Streaming: only choice 0 streams its text (the others run with ``stream=False``); the result holds them all.
Usage: ``prompt_tokens`` and ``cached_tokens`` count the prompt once, ``generated_tokens`` sums the choices,
``prefill_ms`` is the shared prefill plus the slowest choice's first fire, ``decode_tokens_per_s`` sums the
choices' rates (they decode at the same time); ``speculation`` sums the choices' counters.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..forward import ForwardPass
from ..model import Model
from ..spec.stats import SpecStats
from ..working_set import WorkingSet
from .arguments import CompletionArgs

A = TypeVar("A", bound=CompletionArgs)
ChoiceLoop = Callable[[A, WorkingSet], Awaitable[dict]]  # (a choice's args, its working set) → its result
CHOICE_FIELDS = ("text", "token_ids", "finish_reason", "stop_reason", "logprobs")


async def fork_prompt(model: Model, prompt: list[int], n: int) -> tuple[list[WorkingSet], float]:
    """``n`` working sets holding ``prompt[:-1]`` after one prefill (one fresh working set when ``n == 1``),
    and the prefill's ms."""
    base = model.working_set()
    if n == 1:
        return [base], 0.0
    t0 = time.perf_counter()
    forks = [base]
    try:
        if len(prompt) > 1:
            await ForwardPass(base).embed(prompt[:-1]).submit()
        for _ in range(n - 1):
            forks.append(await base.fork())
    except BaseException:
        await asyncio.gather(*(ws.release() for ws in forks), return_exceptions=True)
        raise
    return forks, (time.perf_counter() - t0) * 1e3


async def run_choices(model: Model, args: A, loop: ChoiceLoop[A]) -> dict:
    """Runs ``loop`` once per choice (module docstring) and returns the merged result; a failing choice
    cancels the others. Each loop releases its working set; those left are released here."""
    prompt = args.prompt_ids(model.tokenizer)
    forks, prefill_ms = await fork_prompt(model, prompt, args.n)
    tasks = [asyncio.ensure_future(loop(args.for_choice(i), ws)) for i, ws in enumerate(forks)]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        await asyncio.gather(*(ws.release() for ws in forks), return_exceptions=True)
    return results[0] if args.n == 1 else merge_choices(list(results), prefill_ms)


def merge_choices(results: list[dict], shared_prefill_ms: float) -> dict:
    """One result from the choices' results (module docstring): choice 0's fields at the top, all in ``choices``."""
    first = results[0]
    merged = dict(first)
    merged["choices"] = [{k: r[k] for k in CHOICE_FIELDS if k in r} for r in results]
    stats = dict(first["stats"])
    stats["generated_tokens"] = sum(r["stats"]["generated_tokens"] for r in results)
    stats["prefill_ms"] = round(shared_prefill_ms + max(r["stats"]["prefill_ms"] for r in results), 2)
    stats["decode_tokens_per_s"] = round(sum(r["stats"]["decode_tokens_per_s"] for r in results), 2)
    if "speculation" in first:
        total = SpecStats()
        for r in results:
            total.merge(SpecStats.from_summary(r["speculation"]))
        merged["speculation"] = total.summary()
        stats.update(total.figures())
    merged["stats"] = stats
    return merged
