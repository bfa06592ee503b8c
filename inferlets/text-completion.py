"""text-completion: plain autoregressive decoding, one token a step — the control every speculative
policy is compared against.

    prefill the prompt, read the last row;  loop: embed the new token, read it, until EOS / stop / max_tokens
    (the tokens go through inferlet.text.Output, which cuts them there and at the model's capacity)

Each step reads the engine's Argmax (greedy) or seeded Sample; with presence/frequency/repetition penalties or
a logit bias it reads the step's Logits and picks on the host; with logprobs a Logits readout rides along
(inferlet.text.StepSampler). ``n > 1`` decodes n forks of the prompt after one prefill (inferlet.text.run_choices;
only choice 0 streams).

With --run-ahead the loop stays in the engine (inferlet.spec.run_ahead): an epilogue picks each token (argmax, or
Gumbel sampling from a seeded rng state in a channel) and writes it to the input and output channels; the
engine re-fires the pass with no round trip until EOS or the token budget, and this inferlet only takes the
tokens. A run the engine loop cannot do (n > 1, ignore_eos, penalties, logit bias, logprobs) uses the host loop
and says why in ``stats.device``.
"""

from __future__ import annotations

import time

import inferlet
from inferlet.programs import Builder, Sym, sample
from inferlet.spec import RunAhead
from inferlet.text import CompletionArgs, Output, StepSampler, run_choices


class Args(CompletionArgs):
    run_ahead: bool = False


def host_loop_reason(args: Args) -> str | None:
    """Why a --run-ahead run decodes on the host; None when the engine loop can run it."""
    if args.n > 1:
        return "n > 1"
    if args.ignore_eos:
        return "ignore_eos"  # the engine loop stops at EOS
    reasons = args.fallback_reasons()  # the engine loop picks by argmax or sampling, without logits to the host
    return reasons[0] if reasons else None


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    why = host_loop_reason(args) if args.run_ahead else None
    result = await run_choices(model, args, lambda a, ws: complete(model, a, ws, run_ahead=args.run_ahead and not why))
    if why:
        result["stats"]["device"] = f"host loop: {why} runs are decoded on the host"
    return result


async def complete(model: inferlet.Model, args: Args, ws: inferlet.WorkingSet, run_ahead: bool = False) -> dict:
    """One choice on ``ws`` (fresh, or a fork holding the prompt but its last token); returns its result."""
    prompt = args.prompt_ids(model.tokenizer)
    out = Output(model.tokenizer, args, len(prompt), model.max_positions)
    sampler = StepSampler(args, prompt)
    if args.top_count is not None:
        out.track_logprobs(sampler.logprobs)
    try:
        if run_ahead:
            prefill_ms, decode_s = await engine_loop(ws, prompt, args, out)
        else:
            prefill_ms, decode_s = await host_loop(ws, prompt, sampler, out)
    finally:
        await ws.release()
    cached = min(ws.cached_rows, len(prompt))
    return sampler.result(out, ws, len(prompt), decode_s, cached_tokens=cached, prefill_ms=round(prefill_ms, 2))


async def host_loop(
    ws: inferlet.WorkingSet, prompt: list[int], sampler: StepSampler, out: Output
) -> tuple[float, float]:
    """One fire a token until ``out`` is done; returns (prefill ms, decode s)."""
    t0 = time.perf_counter()
    await sampler.step(ws, prompt[ws.committed :], out)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    t_decode = time.perf_counter()
    while not out.done:
        await sampler.step(ws, out.ids[-1:], out)
    return prefill_ms, time.perf_counter() - t_decode


async def engine_loop(ws: inferlet.WorkingSet, prompt: list[int], args: Args, out: Output) -> tuple[float, float]:
    """Sends the prefill and the run-ahead at once, then takes the tokens until ``out`` is done, the engine
    stopped the run (EOS, the token budget, capacity); returns (prefill ms, decode s)."""
    t0 = time.perf_counter()
    ra = await RunAhead.open(ws, 1)
    try:
        rng = None
        if args.temperature > 0:
            rng = await ra.open_channel((2,), "int64")
            await rng.put([args.seed if args.seed is not None else time.time_ns() % (1 << 31), 0])

        def pick(p: Builder, row: int) -> Sym:
            logits = p.logits([row])
            if rng is None:
                return logits.argmax()
            state = p.take(rng)
            p.put(rng, state + p.const([0, 1]))
            return sample(logits, state, args.temperature, args.top_k, args.top_p)

        def first(p: Builder) -> None:
            t = pick(p, len(prompt) - 1)
            p.put(ra.inp, t)
            p.put(ra.out, t)

        def step(p: Builder) -> None:
            t = pick(p, 0)
            p.put(ra.inp, t)
            p.put(ra.out, t)
            p.fold(1)

        await ra.launch(prompt, first, step, budget_tokens=args.max_tokens - 1)
        out.push(await ra.first())
        prefill_ms = (time.perf_counter() - t0) * 1e3
        t_decode = time.perf_counter()
        await ra.drain(out)
        decode_s = time.perf_counter() - t_decode
        await ra.stop()
    finally:
        await ra.close()
    return prefill_ms, decode_s
