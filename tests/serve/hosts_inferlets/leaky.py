"""Holds two working sets (one forked) and a channel and decodes a token a step, emitting each step, with no
finally: whatever it holds when it is cancelled (or its host dies) must be released for it."""

import asyncio

import inferlet


@inferlet.main
async def main(args: dict) -> dict:
    model = inferlet.model()
    ws = model.working_set()
    prompt = model.tokenizer.encode("x " * 40)
    res = await inferlet.ForwardPass(ws).embed(prompt).readout([len(prompt) - 1], inferlet.Argmax()).submit()
    fork = await ws.fork()
    await inferlet.Channel.open(model, (1,), "int32", 4)
    token = int(res.tokens[0])
    steps, pause = int(args.get("steps", 0)), float(args.get("pause", 0.02))
    n = 0
    while not steps or n < steps:  # steps 0: until cancelled
        for w in (ws, fork):
            if w.committed + 1 < model.max_positions:
                res = await inferlet.ForwardPass(w).embed([token]).readout([0], inferlet.Argmax()).submit()
        inferlet.emit(f"{n} ")
        n += 1
        await asyncio.sleep(pause)
    return {"steps": n}
