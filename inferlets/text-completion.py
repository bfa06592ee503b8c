"""text-completion: plain autoregressive decoding, one token a step — the control every speculative
policy is compared against.

    prefill the prompt, read the last row;  loop: embed the new token, read it, until EOS / stop / max_tokens

With --run-ahead the loop stays in the engine: an epilogue picks each token (argmax, or Gumbel sampling
from a seeded rng state in a channel) and writes it to the input and output channels; the engine re-fires
the pass with no round trip until EOS or the token budget, and this inferlet only takes the tokens.
"""

from __future__ import annotations

import time

import inferlet
from inferlet.args import CompletionArgs
from inferlet.programs import sample


class Args(CompletionArgs):
    run_ahead: bool = False


def readout_kind(args: Args, step: int):
    if args.temperature == 0:
        return inferlet.Argmax()
    seed = None if args.seed is None else args.seed + step  # a seed per step: same seed, same tokens
    return inferlet.Sample(args.temperature, args.top_k, args.top_p, seed)


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    tok = model.tokenizer
    text_in = tok.chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt_ids = tok.encode(text_in)
    ws = model.working_set()
    eos = set(tok.eos_token_ids)
    stream = inferlet.StreamDecoder(tok)

    t0 = time.perf_counter()
    if args.run_ahead:
        tokens, run = await launch_run_ahead(model, ws, prompt_ids, args)
        first = await tokens.__anext__()
    else:
        fp = inferlet.ForwardPass(ws)
        fp.embed(prompt_ids)
        fp.readout([len(prompt_ids) - 1], readout_kind(args, 0))
        first = int((await fp.submit()).tokens[0])
    prefill_ms = (time.perf_counter() - t0) * 1e3

    out: list[int] = []
    finish = "length"
    t_decode = time.perf_counter()
    token = first
    while True:
        if token in eos:
            finish = "eos"
            break
        out.append(token)
        delta = stream.push([token])
        if args.stop and any(s in stream.text for s in args.stop):
            finish = "stop"
            break
        if args.stream and delta:
            inferlet.emit(delta)
        if len(out) >= args.max_tokens:
            break
        if args.run_ahead:
            token = await anext(tokens, None)
            if token is None:  # the engine stopped the run (capacity)
                break
            continue
        if ws.committed + 1 >= model.max_positions:
            break
        fp = inferlet.ForwardPass(ws)
        fp.embed([token])
        fp.readout([0], readout_kind(args, len(out)))
        token = int((await fp.submit()).tokens[0])
    decode_s = time.perf_counter() - t_decode
    if args.run_ahead:
        await run.stop()
    await ws.release()

    text = tok.decode(out)
    if finish == "stop":
        text = text[: min(text.find(s) for s in args.stop if s in text)]
    decoded = max(len(out) - 1, 0)  # the first token came with the prefill
    return {
        "text": text,
        "token_ids": out,
        "finish_reason": finish,
        "stats": {
            "prompt_tokens": len(prompt_ids),
            "generated_tokens": len(out),
            "prefill_ms": round(prefill_ms, 2),
            "decode_tokens_per_s": round(decoded / decode_s, 2) if decode_s > 0 and decoded else 0.0,
        },
    }


TAKE_AT_LEAST = 8  # run-ahead tokens arrive in batches: fewer replies, so less host work per token


class RunAhead:
    """The channels and the in-flight run of --run-ahead; ``stop`` ends it early and waits for its answer."""

    def __init__(self, flag: inferlet.Channel, task, channels: list[inferlet.Channel]):
        self.flag, self.task, self.channels = flag, task, channels

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            await self.flag.set(1)
        if self.task is not None:
            await self.task
        for ch in self.channels:
            await ch.close()


async def launch_run_ahead(model, ws, prompt_ids: list[int], args: Args):
    """Sends the prefill and the run-ahead at once; returns (an async iterator of tokens, the run)."""
    inp = await inferlet.Channel.open(model, (1,), "int32", 1)
    out = await inferlet.Channel.open(model, (1,), "int32", 256)
    flag = await inferlet.Channel.open(model, (), "int32", 1)
    channels = [inp, out, flag]
    rng = None
    if args.temperature > 0:
        rng = await inferlet.Channel.open(model, (2,), "int64", 1)
        await rng.put([args.seed if args.seed is not None else time.time_ns() % (1 << 31), 0])
        channels.append(rng)

    def pick(p, row):
        logits = p.logits([row])
        if rng is None:
            return logits.argmax()
        state = p.take(rng)
        p.put(rng, state + p.const([0, 1]))
        return sample(logits, state, args.temperature, args.top_k, args.top_p)

    def first(p):
        t = pick(p, len(prompt_ids) - 1)
        p.put(inp, t)
        p.put(out, t)

    def step(p):
        t = pick(p, 0)
        p.put(inp, t)
        p.put(out, t)
        p.fold(1)

    await inferlet.ForwardPass(ws).embed(prompt_ids).epilogue(inferlet.trace(model, first)).launch()
    task = None
    if args.max_tokens > 1:
        fp = inferlet.ForwardPass(ws).embed_from(inp).epilogue(inferlet.trace(model, step))
        fp.run_ahead(out, budget_tokens=args.max_tokens - 1, stop_tokens=model.tokenizer.eos_token_ids,
                     stop_channel=flag)
        task = await fp.launch()

    async def tokens():
        while True:
            try:
                cells = await out.take(max=256, min=TAKE_AT_LEAST)
            except inferlet.PieError as e:
                if e.code != inferlet.ErrorCode.CHANNEL_EMPTY:
                    raise
                return
            for t in cells.reshape(-1).tolist():
                yield int(t)

    return tokens(), RunAhead(flag, task, channels)
