"""Best-of-n: n sampled continuations of one prompt, each in a fork()ed working set that shares the
prompt's KV pages, ranked by their mean log-probability under the model.

    pie run examples/best_of_n.py -- --prompt "Write a haiku about the sea." --n 4 --max-tokens 24 --chat
"""

from __future__ import annotations

import asyncio

import numpy as np
from pydantic import BaseModel

import inferlet


class Args(BaseModel):
    prompt: str
    n: int = 4
    max_tokens: int = 32
    temperature: float = 0.8
    seed: int = 0
    chat: bool = False


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


async def continue_branch(ws: inferlet.WorkingSet, first_logits: np.ndarray, args: Args, branch: int, eos: set[int]):
    rng = np.random.default_rng(args.seed * 1000 + branch)
    logits, tokens, logprob = first_logits, [], 0.0
    for _ in range(args.max_tokens):
        lp = log_softmax(logits / args.temperature)
        token = int(rng.choice(len(lp), p=np.exp(lp)))
        logprob += float(log_softmax(logits)[token])
        if token in eos:
            break
        tokens.append(token)
        fp = inferlet.ForwardPass(ws)
        fp.embed([token]).readout([0], inferlet.Logits())
        logits = (await fp.submit()).logits[0]
    await ws.release()
    return tokens, logprob / max(len(tokens), 1)


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    tok = model.tokenizer
    text = tok.chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    ids = tok.encode(text)
    prefix = model.working_set()
    fp = inferlet.ForwardPass(prefix)
    fp.embed(ids).readout([len(ids) - 1], inferlet.Logits())
    first = (await fp.submit()).logits[0]
    branches = [await prefix.fork() for _ in range(args.n)]  # the prompt's pages are shared, not copied
    results = await asyncio.gather(
        *(continue_branch(ws, first, args, i, set(tok.eos_token_ids)) for i, ws in enumerate(branches))
    )
    await prefix.release()
    ranked = sorted(((score, tok.decode(t)) for t, score in results), reverse=True)
    for score, candidate in ranked:
        inferlet.emit(f"[{score:+.3f}] {candidate!r}\n")
    return {"best": ranked[0][1], "candidates": [{"text": t, "mean_logprob": s} for s, t in ranked]}
