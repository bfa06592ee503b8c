"""The prompt-cache routes of `pie serve --prompt-cache-dir DIR` (prompt_caches.py says what a cache is):

    GET    /v1/prompt_caches            the saved caches (name, size, rows, model, weight format, KV dtype)
    POST   /v1/prompt_caches            {"name", "prompt" | "messages"}: prefill and save under the name
    GET    /v1/prompt_caches/{name}     one cache's card
    DELETE /v1/prompt_caches/{name}

A completion or chat request starts from a cache with ``"prompt_cache": NAME`` (app.py), and a run of the
prompt-cache inferlet (``POST /v1/inferlets/prompt-cache/runs``) takes a cache *name* as ``load``: the server
puts the path in (``run_args``), so no request ever hands a host a path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request

from .auth import check_cache_bytes
from .disconnect import unless_disconnected
from .errors import invalid_request
from .generation import check_text, count_tokens
from .openai_api import PromptCacheCard, PromptCacheDeleted, PromptCacheList, SavePromptCache
from .prompt_caches import PROMPT_CACHE, PromptCaches

if TYPE_CHECKING:
    from .app import Server


def run_args(server: Server, key: str, args: dict[str, Any]) -> dict[str, Any]:
    """A prompt-cache run's arguments with its cache name resolved to ``key``'s file (checked against the
    model); a 400 for ``save`` (saves go through ``POST /v1/prompt_caches``, which writes atomically)."""
    caches = server.caches_of(key)
    if "save" in args:
        raise invalid_request("save a prompt cache with POST /v1/prompt_caches", param="args.save")
    if "load" in args:
        assert server.backend.info is not None  # server.runs() checked the backend is ready
        args = {**args, "load": str(caches.checked(args["load"], server.backend.info, "args.load"))}
    return args


def _prompt(server: Server, req: SavePromptCache) -> tuple[str, list[int] | None]:
    """The text to prefill (and its token ids when given as ids); 400s as /tokenize gives them."""
    tok = server.backend.tokenizer
    assert tok is not None
    if (req.prompt is None) == (req.messages is None):
        raise invalid_request("give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        try:
            text = tok.chat([{"role": m.role, "content": m.text()} for m in req.messages], req.add_generation_prompt)
        except ValueError as e:  # no chat template
            raise invalid_request(str(e), param="messages") from e
        check_text(text, "messages")
        return text, None
    if isinstance(req.prompt, list):
        if not req.prompt or any(i < 0 or i >= tok.vocab_size for i in req.prompt):
            raise invalid_request("prompt token ids must be in the vocabulary, and at least one", param="prompt")
        return tok.decode(req.prompt), list(req.prompt)
    check_text(req.prompt or "", "prompt")
    return req.prompt or "", None


def add_prompt_cache_routes(v1: APIRouter, server: Server, api_key: Callable[..., str]) -> None:
    def caches(key: str) -> PromptCaches:
        server.runs()  # 503 while the model loads
        return server.caches_of(key)

    @v1.get("/prompt_caches")
    async def listing(key: str = Depends(api_key)) -> PromptCacheList:
        folder = caches(key)
        return PromptCacheList(data=[folder.card(name) for name in folder.names()])

    @v1.get("/prompt_caches/{name}")
    async def card(name: str, key: str = Depends(api_key)) -> PromptCacheCard:
        folder = caches(key)
        folder.existing(name, "name")
        return folder.card(name)

    @v1.delete("/prompt_caches/{name}")
    async def delete(name: str, key: str = Depends(api_key)) -> PromptCacheDeleted:
        caches(key).existing(name, "name").unlink()
        return PromptCacheDeleted(id=name, deleted=True)

    @v1.post("/prompt_caches")
    async def save(request: Request, req: SavePromptCache, key: str = Depends(api_key)) -> PromptCacheCard:
        folder = caches(key)
        runs = server.runs()
        server.check_model(req.model)
        text, ids = _prompt(server, req)
        tok, limits = server.backend.tokenizer, server.limits()
        assert tok is not None
        count = len(ids) if ids is not None else count_tokens(tok, text, limits.max_model_len)
        if count == 0 or count >= limits.max_model_len:
            why = "the prompt is empty" if count == 0 else f"the prompt fills this model's {limits.max_model_len}"
            raise invalid_request(why, param="prompt", code="empty_prompt" if count == 0 else "context_length_exceeded")
        quota = server.quotas.quota(key)
        check_cache_bytes(quota, folder.bytes_used())  # full already: refused before any work
        scratch = folder.scratch()
        args: dict[str, Any] = {"prompt": text, "chat": False, "save": str(scratch)}
        if ids is not None:
            args["prompt_token_ids"] = ids
        lease = server.quotas.admit(key, count, server.kv_needed(count, 0, 1))
        try:
            events = runs.events(PROMPT_CACHE, args, lease, cache_salt=server.salt(key))
            await unless_disconnected(request, runs.collect(events))
            replaced = folder.path(req.name, "name")
            old = replaced.stat().st_size if replaced.is_file() else 0
            check_cache_bytes(quota, folder.bytes_used() - old, scratch.stat().st_size)
            folder.commit(scratch, req.name)
        finally:
            scratch.unlink(missing_ok=True)
        return folder.card(req.name)
