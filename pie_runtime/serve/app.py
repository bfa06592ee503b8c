"""The routes of `pie serve` (FastAPI): health, metrics, the OpenAI API, tokenize/detokenize and custom
inferlet runs. ``create_app`` builds the app over a ``Backend`` that starts in the background; every route
that needs the model answers 503 ``starting`` until it is up. ``/v1/*`` needs an API key when keys are set.

    GET  /health                      200 serving; 503 loading, restarting a dead engine, failed or draining
    GET  /metrics                     Prometheus text (metrics.py)
    GET  /docs, /openapi.json         the API's schema
    GET  /v1/models                    the model, and MODEL:NAME for each custom inferlet that takes completion
                                      requests (custom_models.py; also the requests' ``inferlet`` field)
    POST /v1/completions, /v1/chat/completions   (stream: SSE chunks, then data: [DONE]; tools: tools.py)
    POST /v1/embeddings                          (embedding_routes.py)
    POST /v1/responses                           (responses_routes.py)
    POST /tokenize, /detokenize
    GET  /v1/inferlets;  POST /v1/inferlets/{name}/runs;  DELETE /v1/inferlets/runs/{id}
    GET, POST /v1/prompt_caches;  GET, DELETE /v1/prompt_caches/{name}   (--prompt-cache-dir: prompt_caches.py)

With keys set, every route but /health needs one (/metrics too, unless ``open_metrics``); a key's uploads,
prompt caches, cached prefixes (a salt a key cannot derive for another) and runs are its own (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, Field

from . import errors
from .auth import KVNeed, KVShape, Lease, Quotas, kv_needed
from .backend import Backend
from .custom_models import SEP, CustomModels
from .disconnect import unless_disconnected
from .embedding_routes import Pooling, add_embedding_routes
from .errors import invalid_request, not_found, run_failed, unavailable
from .generation import Job, Limits, build_job, check_text, completion_prompt, count_tokens
from .host_pool import RunFailed
from .inferlet_routes import add_inferlet_routes
from .metrics import Metrics
from .openai_api import (
    ChatRequest,
    ChatResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    sse_or,
)
from .policies import Capabilities, Policy
from .prompt_cache_routes import add_prompt_cache_routes
from .prompt_caches import PromptCaches, disabled, start_from
from .responses_routes import add_responses_routes
from .runs import Runs, RunSlots
from .sandbox import key_dir
from .streams import chat_response, chat_stream, completion_response, completion_stream, prime, sse_response
from .tenants import RunOwners
from .tool_stream import tool_chat_response, tool_chat_stream
from .tools import plan_tools

DEFAULT_MAX_BODY = 8 << 20
DEFAULT_RUN_TOKENS = 128  # CompletionArgs.max_tokens' default: what a run that does not say is charged
# every route's refusals and failures, as published in the OpenAPI schema
ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "a refused request"},
    "5XX": {"model": ErrorResponse, "description": "a failed run, or the server is not serving (503)"},
}
_ERROR_REF = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
# the same for a route whose own answer is not JSON (errors are, whatever the route)
JSON_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": spec["description"], "content": _ERROR_REF} for code, spec in ERRORS.items()
}


class ServerConfig(BaseModel):
    """The server's limits and speculation policy (from `pie serve`'s command line)."""

    policy: Policy | None = None
    caps: Capabilities = Field(default_factory=Capabilities)
    max_n: int = Field(default=16, ge=1)
    max_tokens: int = Field(default=4096, ge=1)
    max_running: int = Field(default=64, ge=1)
    max_waiting: int = Field(default=512, ge=0)
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY, ge=1024)
    served_name: str | None = None  # the model id clients use (default: the store name)
    prompt_cache_dir: Path | None = None  # saved prompt caches (prompt_caches.py); None: off
    share_prefix_cache: bool = False  # cached prefixes shared across keys (else each key's own: a salt)
    open_metrics: bool = False  # /metrics without a key when keys are set
    stream_stall_timeout: float = Field(default=60.0, gt=0)  # s a stream's client may not read before it ends
    embedding_pooling: Pooling = "mean"  # /v1/embeddings' default pooling (embedding_routes.py)


class Server:
    """The app's state: the backend, quotas, metrics and, once the backend is up, the run tracker."""

    def __init__(self, backend: Backend, config: ServerConfig, quotas: Quotas) -> None:
        self.backend = backend
        self.config = config
        self.quotas = quotas
        self.metrics = Metrics()
        self.created = int(time.time())
        self._runs: Runs | None = None
        self._upload_runs: dict[str, Runs] = {}
        self.slots = RunSlots(config.max_running, config.max_waiting)  # every pool's runs, uploads' included
        self.owners = RunOwners()
        self._salt_secret = os.urandom(32)  # salts no key can derive for another key
        folder = config.prompt_cache_dir
        self.prompt_caches = PromptCaches(folder) if folder is not None else None
        self.custom = CustomModels(backend.inferlet_dirs)  # custom inferlets served as MODEL:NAME

    @property
    def model_id(self) -> str:
        return self.config.served_name or self.backend.model

    def runs(self) -> Runs:
        b = self.backend
        if b.state == "draining":
            raise unavailable("the server is shutting down", "draining")
        if b.state == "restarting":
            raise unavailable(f"{b.error}; it is being restarted, try again shortly", "engine_restarting")
        if b.state != "ready" or b.pool is None:
            raise unavailable(
                "the model is loading" if b.state == "starting" else f"not serving: {b.error}", "starting"
            )
        if self._runs is None:
            self._runs = Runs(b.pool, self.metrics, b.model, self.slots)
        self.slots.kv.capacity = self.kv_capacity()
        self._runs.pool = b.pool  # a restarted engine's
        return self._runs

    def kv_capacity(self) -> int | None:
        """Pages in the one engine's KV pool (the server's KV admission); None with several engines (each has
        its own pool, the router places runs) or a model without a pool."""
        info = self.backend.info
        if self.backend.cluster_counts() is not None or info is None or not info.page_bytes:
            return None
        return info.kv_bytes // info.page_bytes

    async def upload_runs(self, key: str) -> Runs:
        """The runs of ``key``'s uploaded inferlets, in its own sandboxed hosts (started on first use)."""
        uploads = self.backend.uploads
        assert uploads is not None  # the routes check uploads are on
        try:
            pool = await uploads.hosts.pool(key)
        except RunFailed as e:
            raise run_failed(e.code, e.message) from None
        runs = self._upload_runs.get(key)
        if runs is None:  # the server's slots: uploading buys a key no run slots beside its other runs
            runs = self._upload_runs[key] = Runs(pool, self.metrics, self.backend.model, self.slots)
        runs.pool = pool
        return runs

    def caches_of(self, key: str) -> PromptCaches:
        """``key``'s saved prompt caches: a folder of its own (the anonymous client's is the folder itself);
        another key's are not there to list, load, overwrite or delete."""
        if self.prompt_caches is None:
            raise disabled()
        if not key:
            return self.prompt_caches
        folder = self.prompt_caches.folder / key_dir(key)
        folder.mkdir(mode=0o700, exist_ok=True)
        return PromptCaches(folder)

    def prompt_cache(self, key: str, name: str) -> Path:
        """``key``'s saved prompt cache ``name``, checked against the served model (prompt_caches.py's refusals)."""
        assert self.backend.info is not None  # runs() checked the backend is ready
        return self.caches_of(key).checked(name, self.backend.info, "prompt_cache")

    def limits(self) -> Limits:
        info = self.backend.info
        assert info is not None  # runs() checked the backend is ready
        return Limits(info.max_positions, info.page_size, self.config.max_n, self.config.max_tokens)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_id, self.backend.model):
            raise not_found(f"the model {name!r} does not exist (served: {self.model_id})", "model_not_found", "model")

    async def route(self, req: CompletionRequest | ChatRequest) -> str | None:
        """The custom inferlet a request names (``model`` MODEL:NAME or the ``inferlet`` field), None for the
        shipped ones; a 404 for a model or inferlet not served, a 400 for one that takes no completion request."""
        return await self.custom.route(req.model, req.inferlet, (self.model_id, self.backend.model))

    def salt(self, key: str) -> str | None:
        """The prefix-cache salt of ``key``'s runs: cached prefixes are each key's own unless
        ``share_prefix_cache`` (or there are no keys), so a hit tells no key what another sent."""
        if self.config.share_prefix_cache or not key:
            return None
        return hmac.new(self._salt_secret, key.encode(), hashlib.sha256).hexdigest()[:32]

    def admit_run(self, key: str, args: dict[str, Any]) -> Lease:
        """An inferlet run's admission, as a completion's: its ``n`` and ``max_tokens`` (the SDK's defaults
        when absent) within the server's limits (a 400), and its prompt, token budget and KV (pages and bytes)
        charged to the key's quotas (a 429 over one) before it starts."""
        limits = self.limits()
        n = _int_arg(args, "n", 1)
        max_tokens = _int_arg(args, "max_tokens", min(DEFAULT_RUN_TOKENS, limits.max_tokens))
        if n > limits.max_n:
            raise invalid_request(f"n is at most {limits.max_n} on this server", "args.n")
        if max_tokens > limits.max_tokens:
            raise invalid_request(f"max_tokens is at most {limits.max_tokens} on this server", "args.max_tokens")
        ids, text = args.get("prompt_token_ids"), args.get("prompt")
        if isinstance(ids, list):
            prompt = len(ids)
        elif isinstance(text, str):
            prompt = count_tokens(_tokenizer(self.backend), text, limits.max_model_len)
        else:
            prompt = 0
        return self.quotas.admit(key, prompt, self.kv_needed(prompt, max_tokens, n), max_tokens * n)

    def admit(self, key: str, job: Job) -> Lease:
        kv = self.kv_needed(job.prompt_tokens, job.max_tokens, job.n)
        return self.quotas.admit(key, job.prompt_tokens, kv, job.max_tokens * job.n)

    def kv_needed(self, prompt_tokens: int, max_tokens: int, n: int) -> KVNeed:
        """The KV pages and bytes a request's working sets can grow to on the served model (auth.kv_needed)."""
        assert self.backend.info is not None  # runs() checked the backend is ready
        return kv_needed(prompt_tokens, max_tokens, n, KVShape.of(self.backend.info))


def create_app(backend: Backend, config: ServerConfig, quotas: Quotas) -> FastAPI:
    keyed = quotas.required  # with keys, nothing but /health answers without one (/metrics: --open-metrics)
    app = FastAPI(
        title="pie serve",
        description="An OpenAI-compatible API over inferlet runs, and runs of custom inferlets.",
        docs_url=None if keyed else "/docs",
        redoc_url=None,
        openapi_url=None if keyed else "/openapi.json",
        responses=ERRORS,
    )
    server = Server(backend, config, quotas)
    app.state.server = server
    errors.install(app)
    app.add_middleware(errors.BodyLimit, max_bytes=config.max_body_bytes)

    def api_key(authorization: str | None = Header(default=None)) -> str:
        return quotas.authenticate(authorization)

    guard = [Depends(api_key)]
    _add_probe_routes(app, server, [] if config.open_metrics else guard)
    _add_token_routes(app, server, guard)
    if keyed:
        _add_keyed_docs(app, guard)
    v1 = APIRouter(prefix="/v1", dependencies=guard)
    _add_openai_routes(v1, server, api_key)
    add_inferlet_routes(v1, server, api_key)
    add_prompt_cache_routes(v1, server, api_key)
    add_embedding_routes(v1, server, api_key, config.embedding_pooling)
    app.include_router(v1)
    return app


def _add_keyed_docs(app: FastAPI, guard: list[Any]) -> None:
    """/openapi.json and /docs behind the keys (the schema names every route and limit of this server)."""

    @app.get("/openapi.json", include_in_schema=False, dependencies=guard)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guard)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="pie serve")


def _add_probe_routes(app: FastAPI, server: Server, guard: list[Any]) -> None:
    """/health (200 serving; 503 loading, restarting the engine, failed or draining; the engine's life in
    ``engine``) and /metrics (Prometheus text)."""
    backend = server.backend

    @app.get("/health", response_model=Health, responses={503: {"model": Health, "description": "not serving"}})
    async def health() -> Response:
        state = backend.state
        body = Health(status=state, error=backend.error, engine=backend.engine_health())
        return JSONResponse(body.model_dump(exclude_none=True), status_code=200 if state == "ready" else 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses=JSON_ERRORS, dependencies=guard)
    async def metrics() -> Response:
        model = backend.model
        server.metrics.running.labels(model=model).set(server.slots.running)  # uploads' runs included
        server.metrics.waiting.labels(model=model).set(server.slots.waiting)
        server.metrics.kv_admitted.labels(model=model).set(server.slots.kv.held)
        server.metrics.most_running.labels(model=model).set(server.slots.kv.most_admitted)
        page = server.metrics.render(await backend.engine_stats(), backend.cluster_counts(), backend.engine_health())
        return Response(page, media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_token_routes(app: FastAPI, server: Server, guard: list[Any]) -> None:
    """/tokenize (a prompt or chat messages, rendered in the model's template) and /detokenize."""
    backend = server.backend

    @app.post("/tokenize", dependencies=guard)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        server.runs()
        server.check_model(req.model)
        tok = _tokenizer(backend)
        if (req.prompt is None) == (req.messages is None):
            raise invalid_request("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            text = tok.chat([{"role": m.role, "content": m.text()} for m in req.messages], req.add_generation_prompt)
        else:
            text = req.prompt or ""
        limit = server.limits().max_model_len
        check_text(text, "messages" if req.messages is not None else "prompt")
        if count_tokens(tok, text, limit) > limit:  # past the context: not worth the memory of all its ids
            raise invalid_request(
                f"the text has more than {limit} tokens, this model's context", "prompt", "context_length_exceeded"
            )
        ids = tok.encode_prompt(text)  # what the model reads: its BOS included
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=limit)

    @app.post("/detokenize", dependencies=guard)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        server.runs()
        server.check_model(req.model)
        tok = _tokenizer(backend)
        if any(i < 0 or i >= tok.vocab_size for i in req.tokens):
            raise invalid_request("token id out of the vocabulary", param="tokens")
        return DetokenizeResponse(prompt=tok.decode(req.tokens))


def _add_openai_routes(v1: APIRouter, server: Server, api_key: Callable[..., str]) -> None:
    """/v1/models, /v1/completions, /v1/chat/completions and /v1/responses."""
    backend, config = server.backend, server.config

    @v1.get("/models")
    async def models() -> ModelList:
        server.runs()
        limit = server.limits().max_model_len
        base = server.model_id
        cards = [ModelCard(id=base, created=server.created, max_model_len=limit)]
        cards += [
            ModelCard(id=f"{base}{SEP}{name}", created=server.created, max_model_len=limit, parent=base)
            for name in await server.custom.served()
        ]
        return ModelList(data=cards)

    async def generate(
        request: Request,
        req: CompletionRequest | ChatRequest,
        key: str,
        prompt: Callable[..., Any],
        prefix: str,
        stream: Callable[..., AsyncIterator[str]],
        respond: Callable[..., BaseModel],
        session: str | None = None,
        grammar: str | None = None,
    ) -> Response:
        """A completion or chat request (``prompt``, ``stream`` and ``respond`` are its dialect's): admit, run,
        and answer whole or as a stream. ``session`` (the ``x-session-id`` header, else the request's ``user``)
        keeps a conversation on one engine under ``--engines N``."""
        arrival = time.monotonic()
        runs = server.runs()
        custom = await server.route(req)
        tok = _tokenizer(backend)
        job = build_job(req, prompt(tok, req), tok, server.limits(), config.policy, config.caps, grammar, custom)
        if req.prompt_cache is not None:
            if custom is not None:
                raise invalid_request("prompt_cache is not taken by a custom inferlet", "prompt_cache")
            job = start_from(job, req, server.prompt_cache(key, req.prompt_cache))
        lease = server.admit(key, job)
        events = runs.events(
            job.inferlet, job.args, lease, arrival=arrival, session=session or req.user, cache_salt=server.salt(key)
        )
        rid = f"{prefix}-{uuid.uuid4().hex}"
        model = server.model_id if custom is None else f"{server.model_id}{SEP}{custom}"  # what ran, as listed
        if req.stream:
            first = await unless_disconnected(request, prime(events))
            return sse_response(stream(rid, model, req, tok, job, first, events), None, config.stream_stall_timeout)
        result = await unless_disconnected(request, runs.collect(events))
        return JSONResponse(respond(rid, model, tok, job, result, req.return_token_ids).model_dump(exclude_none=True))

    @v1.post("/completions", response_model=None, responses=sse_or(CompletionResponse))
    async def completions(
        request: Request,
        req: CompletionRequest,
        key: str = Depends(api_key),
        x_session_id: str | None = Header(default=None),
    ) -> Response:
        return await generate(
            request, req, key, completion_prompt, "cmpl", completion_stream, completion_response, x_session_id
        )

    @v1.post("/chat/completions", response_model=None, responses=sse_or(ChatResponse))
    async def chat(
        request: Request, req: ChatRequest, key: str = Depends(api_key), x_session_id: str | None = Header(default=None)
    ) -> Response:
        plan = plan_tools(req)  # tools.py: the prompt shows the tools, a grammar holds the calls
        if not plan.calls:
            return await generate(request, req, key, plan.prompt, "chatcmpl", chat_stream, chat_response, x_session_id)
        stream, respond = tool_chat_stream, tool_chat_response
        return await generate(request, req, key, plan.prompt, "chatcmpl", stream, respond, x_session_id, plan.grammar)

    add_responses_routes(v1, api_key, generate)  # /v1/responses runs through chat's path


def _int_arg(args: dict[str, Any], name: str, default: int) -> int:
    """An integer run argument, or its default when absent or not an integer (the host's Args refuse that)."""
    value = args.get(name, default)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _tokenizer(backend: Backend):
    assert backend.tokenizer is not None  # Server.runs() checked the backend is ready
    return backend.tokenizer
