"""Prefills a working set, says so, then waits until cancelled: a cancelled run must release its pages."""

import asyncio

import inferlet


@inferlet.main
async def main(args: dict) -> dict:
    model = inferlet.model()
    ws = model.working_set()
    prompt = model.tokenizer.encode("hold " * int(args.get("tokens", 200)))
    await inferlet.ForwardPass(ws).embed(prompt).readout([len(prompt) - 1], inferlet.Argmax()).submit()
    inferlet.emit("holding")
    await asyncio.sleep(3600)
    return {}
