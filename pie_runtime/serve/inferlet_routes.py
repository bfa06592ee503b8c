"""Custom inferlet routes of `pie serve`:

    GET    /v1/inferlets                 shipped, custom (--inferlets DIR) and uploaded inferlets
    POST   /v1/inferlets                 upload one (403 unless --allow-upload): {"name", "source"}
    POST   /v1/inferlets/{name}/runs     {"args": {...}, "stream": false} → {"id", "result"};
                                         stream: SSE {"type": "run"}, {"type": "text"}..., {"type": "result"}, [DONE]
    DELETE /v1/inferlets/runs/{id}       cancels a run (its working sets are released)

Code runs only from the server's own folders. An uploaded file goes to the server's upload folder and runs in
the upload pool's hosts (resource limits, no server environment), never beside the other runs; it cannot
take a shipped or custom inferlet's name. A prompt-cache run's ``load`` is a cache name of
``--prompt-cache-dir``, resolved by the server (prompt_cache_routes.py), and it saves only through
``POST /v1/prompt_caches``. No other argument that names a file on the server's machine is taken from a
request (``HOST_PATH_ARGS``: a 400): the suffix store's static index is the server's ``--suffix-index``. The run
id comes back in the ``x-pie-run-id`` header.
"""

from __future__ import annotations

import os
import re
import tempfile
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


def shipped_run_args(server: Server, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """A shipped inferlet's run arguments as a request gave them, checked: a prompt-cache run's cache name
    resolved to the server's file, and a 400 for an argument that names a file on the server's machine."""
    if name == PROMPT_CACHE:
        return run_args(server, args)
    for key in args:
        if key.replace("-", "_") in HOST_PATH_ARGS.get(name, ()):
            raise invalid_request(
                f"{key!r} names a file on the server's machine: not taken from a request", f"args.{key}"
            )
    return args


class UploadRequest(BaseModel):
    name: str = Field(pattern=NAME.pattern)
    source: str = Field(min_length=1)


def add_inferlet_routes(v1: APIRouter, server: Server, api_key: Callable[..., str]) -> None:
    def uploaded() -> dict[str, Path]:
        uploads = server.backend.uploads
        if uploads is None or server.upload_runs() is None:
            return {}
        return {p.stem: p for p in sorted(uploads.folder.glob("*.py"))}

    def runs_for(name: str) -> Runs:
        runs = server.runs()
        if name in runs.pool.inferlets():
            return runs
        upload_runs = server.upload_runs()
        if upload_runs is not None and name in uploaded():
            return upload_runs
        raise not_found(f"no inferlet {name!r}", "inferlet_not_found", "name")

    @v1.get("/inferlets")
    async def inferlets() -> InferletList:
        runs = server.runs()
        shipped = set(shipped_inferlets())
        data = [
            InferletCard(id=name, source="shipped" if name in shipped else "custom")
            for name in sorted(runs.pool.inferlets())
        ]
        data += [InferletCard(id=name, source="uploaded") for name in uploaded()]
        return InferletList(data=data)

    @v1.post("/inferlets")
    async def upload(req: UploadRequest) -> InferletCard:
        runs = server.runs()
        uploads = server.backend.uploads
        if uploads is None or server.upload_runs() is None:
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
        fd, tmp = tempfile.mkstemp(dir=uploads.folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(req.source)
        os.replace(tmp, uploads.folder / f"{req.name}.py")  # atomic: a run never loads half a file
        return InferletCard(id=req.name, source="uploaded")

    @v1.post("/inferlets/{name}/runs", response_model=None, responses=sse_or(RunResponse))
    async def run(request: Request, name: str, req: RunRequest, key: str = Depends(api_key)) -> Response:
        arrival = time.monotonic()
        runs = runs_for(name)
        args = shipped_run_args(server, name, req.args) if runs is server.runs() else req.args
        lease = server.quotas.admit(key, 0, 0)
        run_id = runs.new_id()
        events = runs.events(name, args, lease, run_id=run_id, arrival=arrival)
        headers = {"x-pie-run-id": run_id}
        if req.stream:
            first = await unless_disconnected(request, prime(events))
            return sse_response(_run_stream(run_id, name, first, events), headers)
        result = await unless_disconnected(request, runs.collect(events))
        body = RunResponse(id=run_id, inferlet=name, result=result)
        return JSONResponse(body.model_dump(), headers=headers)

    @v1.delete("/inferlets/runs/{run_id}")
    async def cancel(run_id: str) -> RunCancelled:
        pools = [server.runs().pool] + [r.pool for r in (server.upload_runs(),) if r is not None]
        for pool in pools:
            if await pool.cancel(run_id):
                return RunCancelled(id=run_id, cancelled=True)
        raise not_found(f"no running run {run_id!r}", "run_not_found", "run_id")


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
