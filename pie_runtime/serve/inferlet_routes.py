"""Custom inferlet routes of `pie serve`:

    GET    /v1/inferlets                 shipped, custom (--inferlets DIR) and uploaded inferlets
    POST   /v1/inferlets                 upload one (403 unless --allow-upload): {"name", "source"}
    POST   /v1/inferlets/{name}/runs     {"args": {...}, "stream": false} → {"id", "result"};
                                         stream: SSE {"type": "run"}, {"type": "text"}..., {"type": "result"}, [DONE]
    DELETE /v1/inferlets/runs/{id}       cancels a run (its working sets are released)

Code runs only from the server's own folders. An uploaded file goes to its key's own upload folder and runs in
that key's sandboxed hosts (sandbox.py, tenants.py), never beside the other runs or another key's; another key
neither lists nor runs it, and it cannot take a shipped or custom inferlet's name. A run id belongs to the key
that started it: another key's cancel is a 404. A prompt-cache run's ``load`` is a cache name of
``--prompt-cache-dir``, resolved by the server (prompt_cache_routes.py), and it saves only through
``POST /v1/prompt_caches``. No other argument that names a file on the server's machine is taken from a
request (``HOST_PATH_ARGS``: a 400): the suffix store's static index is the server's ``--suffix-index``. The run
id comes back in the ``x-pie-run-id`` header.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from ..launcher import shipped_inferlets
from .disconnect import unless_disconnected
from .errors import APIError, invalid_request, not_found
from .openai_api import InferletCard, InferletList, RunCancelled, RunRequest, RunResponse, sse_or
from .prompt_cache_routes import run_args
from .prompt_caches import PROMPT_CACHE
from .streams import prime, sse, sse_response

if TYPE_CHECKING:
    from .app import Server
    from .runs import Runs

NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
# shipped inferlets' arguments that name a file on the server's machine, which a request must not choose
HOST_PATH_ARGS = {"suffix-speculative-decoding": ("suffix_index", "save_index")}


def shipped_run_args(server: Server, key: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """A shipped inferlet's run arguments as a request gave them, checked: a prompt-cache run's cache name
    resolved to the key's file, and a 400 for an argument that names a file on the server's machine."""
    if name == PROMPT_CACHE:
        return run_args(server, key, args)
    for arg in args:
        if arg.replace("-", "_") in HOST_PATH_ARGS.get(name, ()):
            raise invalid_request(
                f"{arg!r} names a file on the server's machine: not taken from a request", f"args.{arg}"
            )
    return args


class UploadRequest(BaseModel):
    name: str = Field(pattern=NAME.pattern)
    source: str = Field(min_length=1)


def add_inferlet_routes(v1: APIRouter, server: Server, api_key: Callable[..., str]) -> None:
    def uploaded(key: str) -> dict[str, Path]:
        uploads = server.backend.uploads
        return {} if uploads is None else uploads.hosts.uploaded(key)

    async def runs_for(key: str, name: str) -> tuple[Runs, bool]:
        """The runs that serve ``name`` for ``key``, and whether it is one of the key's uploads."""
        runs = server.runs()
        if name in runs.pool.inferlets():
            return runs, False
        if name in uploaded(key):
            return await server.upload_runs(key), True
        raise not_found(f"no inferlet {name!r}", "inferlet_not_found", "name")

    @v1.get("/inferlets")
    async def inferlets(key: str = Depends(api_key)) -> InferletList:
        runs = server.runs()
        shipped = set(shipped_inferlets())
        data = [
            InferletCard(id=name, source="shipped" if name in shipped else "custom")
            for name in sorted(runs.pool.inferlets())
        ]
        data += [InferletCard(id=name, source="uploaded") for name in uploaded(key)]
        return InferletList(data=data)

    @v1.post("/inferlets")
    async def upload(req: UploadRequest, key: str = Depends(api_key)) -> InferletCard:
        runs = server.runs()
        uploads = server.backend.uploads
        if uploads is None:
            raise APIError(
                403, "uploading inferlets is off (start with --allow-upload)", "permission_error", "upload_disabled"
            )
        if req.name in runs.pool.inferlets():
            raise APIError(
                409, f"{req.name!r} is a served inferlet's name", "invalid_request_error", "name_taken", "name"
            )
        try:
            compile(req.source, f"{req.name}.py", "exec")
        except SyntaxError as e:
            raise APIError(
                400, f"the source does not compile: {e}", "invalid_request_error", "bad_source", "source"
            ) from e
        uploads.hosts.write(key, req.name, req.source)
        return InferletCard(id=req.name, source="uploaded")

    @v1.post("/inferlets/{name}/runs", response_model=None, responses=sse_or(RunResponse))
    async def run(request: Request, name: str, req: RunRequest, key: str = Depends(api_key)) -> Response:
        arrival = time.monotonic()
        runs, is_upload = await runs_for(key, name)
        args = req.args if is_upload else shipped_run_args(server, key, name, req.args)
        lease = server.admit_run(key, args)
        run_id = runs.new_id()
        server.owners.add(run_id, key)
        salt = server.salt(key)
        events = owned(server, run_id, runs.events(name, args, lease, run_id=run_id, arrival=arrival, cache_salt=salt))
        headers = {"x-pie-run-id": run_id}
        if req.stream:
            first = await unless_disconnected(request, prime(events))
            return sse_response(_run_stream(run_id, name, first, events), headers, server.config.stream_stall_timeout)
        result = await unless_disconnected(request, runs.collect(events))
        body = RunResponse(id=run_id, inferlet=name, result=result)
        return JSONResponse(body.model_dump(), headers=headers)

    @v1.delete("/inferlets/runs/{run_id}")
    async def cancel(run_id: str, key: str = Depends(api_key)) -> RunCancelled:
        if server.owners.owns(key, run_id):  # another key's run is not there for this one
            pools = [server.runs().pool]
            uploads = server.backend.uploads
            if uploads is not None:
                pools += uploads.hosts.pools()
            for pool in pools:
                if await pool.cancel(run_id):
                    return RunCancelled(id=run_id, cancelled=True)
        raise not_found(f"no running run {run_id!r}", "run_not_found", "run_id")


async def owned(server: Server, run_id: str, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``events``, with the run id known as its key's until they end."""
    try:
        async for ev in events:
            yield ev
    finally:
        server.owners.discard(run_id)
        await events.aclose()  # type: ignore[attr-defined]


async def _run_stream(run_id: str, name: str, first: Any, events: AsyncIterator[Any]) -> AsyncIterator[str]:
    async def all_events() -> AsyncIterator[Any]:
        if first is not None:
            yield first
        async for ev in events:
            yield ev

    try:
        yield sse({"type": "run", "id": run_id, "inferlet": name})
        async for ev in all_events():
            if ev.kind == "text":
                yield sse({"type": "text", "text": ev.text})
            else:
                yield sse({"type": "result", "result": ev.result})
    except APIError as e:
        yield sse(e.body())
    yield "data: [DONE]\n\n"
