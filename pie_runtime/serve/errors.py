"""The HTTP server's errors: one exception type carrying the OpenAI error object
``{"error": {"message", "type", "param", "code"}}`` and its status, the handlers that turn every failure
(a refused request, malformed JSON, wrong types, an unknown route, an inferlet's run failing) into that shape,
and a body-size guard (413). The server keeps serving after each: nothing here ends a process."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# RunFailed.code (serve/host_pool.py) → HTTP status and OpenAI error type
RUN_FAILURES: dict[str, tuple[int, str]] = {
    "bad_arguments": (400, "invalid_request_error"),
    "inferlet_error": (500, "server_error"),
    "host_crashed": (500, "server_error"),
    "engine_lost": (503, "server_error"),  # pie serve --engines: the run's engine died (cluster/pool.py)
    "cancelled": (409, "cancelled_error"),
    "timeout": (504, "timeout_error"),
    "overloaded": (503, "overloaded_error"),
    "not_found": (404, "not_found_error"),
}


class APIError(Exception):
    """A refused or failed request: its HTTP status and the fields of the OpenAI error object."""

    def __init__(self, status: int, message: str, type: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


def authentication(message: str = "invalid or missing API key") -> APIError:
    return APIError(401, message, "authentication_error", "invalid_api_key")


def not_found(message: str, code: str, param: str | None = None) -> APIError:
    return APIError(404, message, "not_found_error", code, param)


def rate_limited(message: str, quota: str) -> APIError:
    return APIError(429, message, "rate_limit_error", "quota_exceeded", quota)


def unavailable(message: str, code: str) -> APIError:
    """503: ``starting`` (the model is loading), ``overloaded`` (queue full) or ``draining``."""
    return APIError(503, message, "service_unavailable_error", code)


def run_failed(code: str, message: str) -> APIError:
    """The error object for an inferlet run that failed in its host (``RunFailed``)."""
    status, type_ = RUN_FAILURES.get(code, (500, "server_error"))
    return APIError(status, message, type_, code)


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or None


def install(app: FastAPI) -> None:
    """Routes every failure through the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return invalid_request("malformed JSON body", code="invalid_json").response()
        loc = tuple(first.get("loc", ()))
        param = _param(loc)
        msg = first.get("msg", "invalid request")
        text = f"{param}: {msg}" if param else msg
        return invalid_request(text, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = not_found(f"no route {request.method} {request.url.path}", "route_not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"method {request.method} not allowed here", "invalid_request_error", "bad_method")
        else:
            err = APIError(exc.status_code, str(exc.detail), "invalid_request_error")
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", "internal").response()


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` (by Content-Length, or counted as it streams in)
    gets 413 before any route reads it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(
            413, f"request body is larger than {self.max_bytes} bytes", "invalid_request_error", "request_too_large"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _BodyTooLarge:
            await self._too_large().response()(scope, receive, send)


class _BodyTooLarge(Exception):
    pass
