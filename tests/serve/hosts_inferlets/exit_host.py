"""Emits its host's pid, then ends the whole host process with os._exit (no cleanup of any kind runs)."""

import asyncio
import os

import inferlet


@inferlet.main
async def main(args: dict) -> dict:
    model = inferlet.model()
    ws = model.working_set()
    await inferlet.ForwardPass(ws).embed(model.tokenizer.encode("an exit")).readout([0], inferlet.Argmax()).submit()
    inferlet.emit(str(os.getpid()))
    await asyncio.sleep(float(args.get("delay", 0.2)))  # the test reads the pid first
    os._exit(3)
