"""text-completion: plain autoregressive decoding, one token a step — the control every speculative
policy is compared against.

    prefill the prompt, read the last row;  loop: embed the new token, read it, until EOS / stop / max_tokens
"""

from __future__ import annotations

import time

from pydantic import BaseModel

import inferlet


class Args(BaseModel):
    prompt: str
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    chat: bool = False
    stream: bool = True


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
    fp = inferlet.ForwardPass(ws)
    fp.embed(prompt_ids)
    fp.readout([len(prompt_ids) - 1], readout_kind(args, 0))
    res = await fp.submit()
    prefill_ms = (time.perf_counter() - t0) * 1e3

    out: list[int] = []
    finish = "length"
    t_decode = time.perf_counter()
    while True:
        token = int(res.tokens[0])
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
        if len(out) >= args.max_tokens or ws.committed + 1 >= model.max_positions:
            break
        fp = inferlet.ForwardPass(ws)
        fp.embed([token])
        fp.readout([0], readout_kind(args, len(out)))
        res = await fp.submit()
    decode_s = time.perf_counter() - t_decode
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
