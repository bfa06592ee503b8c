"""``POST /v1/embeddings``: one vector per input from the model's final hidden states, computed by the shipped
``embeddings`` inferlet (inferlets/embeddings.py: the Hidden readout, pooled by mean or last token, then
L2-normalized).

    input            a string, a list of strings, a list of token ids, or a list of lists of token ids
    encoding_format  "float" (lists of numbers) or "base64" (little-endian float32 bytes, as OpenAI sends them;
                     the openai client asks for it by default and decodes it)
    dimensions       refused unless it is the model's hidden size (the vectors are not truncatable)
    pooling          pie's extension: "mean" or "last" (default: the server's --embedding-pooling)

The request is admitted as any run (its tokens and the KV pages of its inputs count against the key's quotas).
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from .disconnect import unless_disconnected
from .errors import invalid_request
from .generation import Job, check_text

if TYPE_CHECKING:
    from collections.abc import Callable

    from .app import Server

EMBEDDINGS = "embeddings"  # the shipped inferlet
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request

Pooling = Literal["mean", "last"]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    pooling: Pooling | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def input_ids(server: Server, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids (strings tokenized with the model's tokenizer), checked: not empty, within the
    vocabulary and the context, at most MAX_INPUTS of them."""
    tok = server.backend.tokenizer
    assert tok is not None  # runs() checked the backend is ready
    raw = req.input
    items: list[Any] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not items:
        raise invalid_request("input is empty", param="input")
    if len(items) > MAX_INPUTS:
        raise invalid_request(f"at most {MAX_INPUTS} inputs per request", param="input")
    limit = server.limits().max_model_len
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            check_text(item, "input")
            ids = tok.encode_prompt(item)  # what the model reads: its BOS included
        else:
            ids = [int(t) for t in item]
            if any(t < 0 or t >= tok.vocab_size for t in ids):
                raise invalid_request(f"input {i}: a token id is out of the vocabulary", param="input")
        if not ids:
            raise invalid_request(f"input {i} is empty", param="input")
        if len(ids) > limit:
            raise invalid_request(
                f"input {i} has {len(ids)} tokens; this model's context is {limit}", "input", "context_length_exceeded"
            )
        out.append(ids)
    return out


def encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def add_embedding_routes(v1: APIRouter, server: Server, api_key: Callable[..., str], pooling: Pooling) -> None:
    @v1.post("/embeddings")
    async def embeddings(request: Request, req: EmbeddingRequest, key: str = Depends(api_key)) -> EmbeddingResponse:
        arrival = time.monotonic()
        runs = server.runs()
        server.check_model(req.model)
        info = server.backend.info
        assert info is not None  # runs() checked the backend is ready
        if req.dimensions is not None and req.dimensions != info.hidden_size:
            raise invalid_request(
                f"dimensions={req.dimensions} is not served: this model's embeddings have {info.hidden_size}",
                param="dimensions",
            )
        ids = input_ids(server, req)
        tokens = sum(len(i) for i in ids)
        args = {"inputs": ids, "pooling": req.pooling or pooling}
        lease = server.admit(key, Job(EMBEDDINGS, args, prompt_tokens=tokens, max_tokens=0, n=1))
        events = runs.events(EMBEDDINGS, args, lease, arrival=arrival, session=req.user, cache_salt=server.salt(key))
        result = await unless_disconnected(request, runs.collect(events))
        data = [Embedding(index=i, embedding=encoded(v, req.encoding_format)) for i, v in enumerate(result["data"])]
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingResponse(data=data, model=server.model_id, usage=usage)
