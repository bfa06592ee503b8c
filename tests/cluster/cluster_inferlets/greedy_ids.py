"""Greedy decoding from token ids, one fire a token, emitting each token: a run with no text prompt, so
the cluster does not run it again when its engine is lost."""

from __future__ import annotations

from pydantic import BaseModel

import inferlet


class Args(BaseModel):
    ids: list[int]
    max_tokens: int = 32


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    ws = model.working_set()
    window, out = list(args.ids), []
    for _ in range(args.max_tokens):
        fp = inferlet.ForwardPass(ws)
        fp.embed(window).readout([len(window) - 1], inferlet.Argmax())
        token = int((await fp.submit()).tokens[0])
        out.append(token)
        inferlet.emit(f"{token} ")
        window = [token]
    await ws.release()
    return {"token_ids": out}
