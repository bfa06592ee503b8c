"""Fires once, leaves its working set open and raises: the run fails, its host and the other runs do not."""

import inferlet


@inferlet.main
async def main(args: dict) -> dict:
    model = inferlet.model()
    ws = model.working_set()
    await inferlet.ForwardPass(ws).embed(model.tokenizer.encode("a crash")).readout([0], inferlet.Argmax()).submit()
    raise RuntimeError("boom")
