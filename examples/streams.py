"""Many greedy streams in one inferlet process: each prompt decodes in its own working set, all at once (the engine
batches their passes), one token a step as text-completion's host loop does. The measure of
examples/bench_streams_openvino.py against OpenVINO GenAI's ContinuousBatchingPipeline.

    pie run examples/streams.py -- --prompts-file ids.json --max-tokens 128

``ids.json`` holds a list of prompts, each a list of token ids (used as they are). Returns each stream's token ids,
the total new tokens and the wall seconds from the first prefill to the last token (prefill included).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from pydantic import BaseModel, Field

import inferlet
from inferlet.text import CompletionArgs, Output, StepSampler


class Args(BaseModel):
    prompts_file: str
    max_tokens: int = Field(default=128, ge=1)


async def stream(model: inferlet.Model, ids: list[int], max_tokens: int) -> list[int]:
    """One greedy stream of ``ids`` in its own working set; its new token ids."""
    args = CompletionArgs(prompt="", prompt_token_ids=ids, max_tokens=max_tokens, stream=False)
    out = Output(model.tokenizer, args, len(ids), model.max_positions)
    sampler = StepSampler(args, ids)
    ws = model.working_set()
    try:
        await sampler.step(ws, ids, out)
        while not out.done:
            await sampler.step(ws, out.ids[-1:], out)
    finally:
        await ws.release()
    return list(out.ids)


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    prompts = json.loads(Path(args.prompts_file).read_text())
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(stream(model, p, args.max_tokens) for p in prompts))
    seconds = time.perf_counter() - t0
    total = sum(len(o) for o in outs)
    return {"token_ids": outs, "total_tokens": total, "seconds": seconds, "tokens_per_s": total / seconds}
