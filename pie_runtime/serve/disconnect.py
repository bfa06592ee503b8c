"""Cancels the work of a request whose client went away before its answer began: a whole (non-streamed)
answer, or a stream's wait for its first event. Cancelling a run's event iterator cancels the run in its host,
which releases its working sets (runs.py). Once a stream has begun, Starlette's StreamingResponse watches for
the disconnect itself and cancels the stream the same way."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from .errors import APIError

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read already: the next ASGI message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; when the client disconnects first, ``work`` is cancelled and a 499 raised (an answer
    nobody reads)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise APIError(499, "the client closed the request", "invalid_request_error", "client_closed")
    return task.result()
