"""Deferred fold: guess the next few tokens, fire them with the fold left open, and commit only as many as
the model agrees with — a hand-written speculation round in a dozen lines.

Each round guesses by repeating the last k tokens (a deliberately naive drafter), verifies the window
[last, guess...] in one fire with fold DEFERRED, then settles the fold with ``ws.fold(accepted + 1)``.
The output equals greedy decoding's; the rounds that accept guesses save forward passes.

    pie run examples/deferred_fold.py -- --prompt "1, 2, 3, 1, 2, 3, 1, 2," --max-tokens 24
"""

from __future__ import annotations

from pydantic import BaseModel

import inferlet


class Args(BaseModel):
    prompt: str
    max_tokens: int = 32
    guess: int = 3


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    ids = model.tokenizer.encode_prompt(args.prompt)
    ws = model.working_set()
    fp = inferlet.ForwardPass(ws)
    fp.embed(ids[:-1])
    await fp.submit()
    last, out, rounds, accepted_total = ids[-1], [], 0, 0
    history = list(ids)
    while len(out) < args.max_tokens:
        period = args.guess
        guess = history[-period:][:period] if len(history) >= period else []
        window = [last] + guess
        fp = inferlet.ForwardPass(ws)
        fp.embed(window).readout(range(len(window)), inferlet.Argmax()).fold(inferlet.DEFERRED)
        target = [int(t) for t in (await fp.submit()).tokens]
        accepted = 0
        while accepted < len(guess) and guess[accepted] == target[accepted]:
            accepted += 1
        await ws.fold(accepted + 1)  # commit `last` and the agreed guesses; the rest is overwritten next time
        new = guess[:accepted] + [target[accepted]]
        out += new
        history += new
        last = new[-1]
        rounds += 1
        accepted_total += accepted
    await ws.release()
    out = out[: args.max_tokens]
    inferlet.emit(model.tokenizer.decode(out))
    return {"text": model.tokenizer.decode(out), "token_ids": out, "rounds": rounds, "accepted": accepted_total}
