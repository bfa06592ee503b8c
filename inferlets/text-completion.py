"""text-completion: plain autoregressive decoding, one token a step — the control every speculative
policy is compared against.

    prefill the prompt, read the last row;  loop: embed the new token, read it, until EOS / stop / max_tokens
    (the tokens go through inferlet.output.Output, which cuts them there and at the model's capacity)

With --run-ahead the loop stays in the engine (inferlet.run_ahead): an epilogue picks each token (argmax, or
Gumbel sampling from a seeded rng state in a channel) and writes it to the input and output channels; the
engine re-fires the pass with no round trip until EOS or the token budget, and this inferlet only takes the
tokens.
"""

from __future__ import annotations

import time

import inferlet
from inferlet.args import CompletionArgs
from inferlet.output import Output
from inferlet.programs import Builder, Sym, sample
from inferlet.run_ahead import RunAhead


class Args(CompletionArgs):
    run_ahead: bool = False


def readout_kind(args: Args, step: int) -> inferlet.Argmax | inferlet.Sample:
    if args.temperature == 0:
        return inferlet.Argmax()
    seed = None if args.seed is None else args.seed + step  # a seed per step: same seed, same tokens
    return inferlet.Sample(args.temperature, args.top_k, args.top_p, seed)


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    prompt = args.prompt_ids(model.tokenizer)
    out = Output(model.tokenizer, args, len(prompt), model.max_positions)
    ws = model.working_set()
    try:
        decode = run_ahead if args.run_ahead else host_loop
        prefill_ms, decode_s = await decode(ws, prompt, args, out)
    finally:
        await ws.release()
    decoded = max(len(out.ids) - 1, 0)  # the first token came with the prefill
    return {
        "text": out.text(),
        "token_ids": out.ids,
        "finish_reason": out.finish or "length",
        "stats": {
            "prompt_tokens": len(prompt),
            "generated_tokens": len(out.ids),
            "prefill_ms": round(prefill_ms, 2),
            "decode_tokens_per_s": round(decoded / decode_s, 2) if decode_s > 0 and decoded else 0.0,
        },
    }


async def host_loop(ws: inferlet.WorkingSet, prompt: list[int], args: Args, out: Output) -> tuple[float, float]:
    """One fire a token until ``out`` is done; returns (prefill ms, decode s)."""
    t0 = time.perf_counter()
    fp = inferlet.ForwardPass(ws).embed(prompt).readout([len(prompt) - 1], readout_kind(args, 0))
    out.push([int((await fp.submit()).tokens[0])])
    prefill_ms = (time.perf_counter() - t0) * 1e3
    t_decode = time.perf_counter()
    while not out.done:
        fp = inferlet.ForwardPass(ws).embed(out.ids[-1:]).readout([0], readout_kind(args, len(out.ids)))
        out.push([int((await fp.submit()).tokens[0])])
    return prefill_ms, time.perf_counter() - t_decode


async def run_ahead(ws: inferlet.WorkingSet, prompt: list[int], args: Args, out: Output) -> tuple[float, float]:
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
