"""embeddings: one vector per input from the model's final hidden states (the Hidden readout), pooled and
L2-normalized, as `pie serve`'s /v1/embeddings serves them. Copy it to pool another way (a weighted mean, a
CLS-like first token, an attention-weighted mean) and serve it with ``--inferlets DIR``.

Reimers & Gurevych 2019, "Sentence-BERT" (mean pooling); Wang et al. 2024, "Improving Text Embeddings with
Large Language Models" (last-token pooling of a decoder).

    for each input (at most `parallel` at once; the engine batches their fires):
        for each chunk of `chunk` tokens:  fire(chunk, readout Hidden on every row (mean) or the input's last row)
        mean: v = sum of the rows' hidden states / tokens;  last: v = the last row's
        v = v / |v|  (with normalize)
"""

from __future__ import annotations

import asyncio
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

import inferlet

MAX_INPUTS = 2048


class Args(BaseModel):
    inputs: list[list[int]] = Field(min_length=1, max_length=MAX_INPUTS)  # token ids, one list per input
    pooling: Literal["mean", "last"] = "mean"
    normalize: bool = True
    chunk: int = Field(default=256, ge=1, le=4096)  # rows a fire embeds (bounds a reply's hidden states)
    parallel: int = Field(default=8, ge=1, le=64)  # inputs embedded at once


async def embed(model: inferlet.Model, ids: list[int], args: Args) -> np.ndarray:
    """One input's pooled (and normalized) hidden state, float64 (hidden,)."""
    if not ids:
        raise ValueError("an input has no tokens")
    ws = model.working_set()
    total = np.zeros(model.hidden_size, dtype=np.float64)
    try:
        for start in range(0, len(ids), args.chunk):
            piece = ids[start : start + args.chunk]
            last = start + len(piece) == len(ids)
            fp = inferlet.ForwardPass(ws).embed(piece)
            if args.pooling == "mean":
                fp.readout(range(len(piece)), inferlet.Hidden())
            elif last:
                fp.readout([len(piece) - 1], inferlet.Hidden())
            res = await fp.submit()
            if res.hidden is not None:
                total += res.hidden.astype(np.float64).sum(axis=0)
    finally:
        await ws.release()
    v = total / len(ids) if args.pooling == "mean" else total
    if args.normalize:
        norm = np.linalg.norm(v)
        v = v / norm if norm > 0 else v
    return v


@inferlet.main
async def main(args: Args) -> dict:
    model = inferlet.model()
    if any(i < 0 or i >= model.vocab_size for ids in args.inputs for i in ids):
        raise ValueError("a token id is out of the vocabulary")
    gate = asyncio.Semaphore(args.parallel)

    async def one(ids: list[int]) -> list[float]:
        async with gate:
            return (await embed(model, ids, args)).astype(np.float32).tolist()

    data = await asyncio.gather(*(one(ids) for ids in args.inputs))
    return {"data": data, "dimensions": model.hidden_size, "prompt_tokens": sum(len(i) for i in args.inputs)}
