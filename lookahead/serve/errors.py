"""Errors as the OpenAI API shapes them: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

A client's mistake is a 4xx that names the field (`param`) and says what was wrong with it; only the server's own
failures are 5xx (a 503 says when to come back: `Retry-After`). `install` makes every error the app can raise speak
this shape: ours (`APIError`), Starlette's (unknown route, wrong method) and any other (a 500 that says so).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("lookahead.serve")

RETRY_AFTER_S = 1  # what a 503 tells the client to wait before trying again
CLIENT_CLOSED = 499  # the status counted for a request whose client left before its answer (nginx's)


class FieldError(Exception):
    """A request that names a field this server refuses (raised from validators: pydantic lets it through as is)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


class APIError(Exception):
    """An error response: status, message, and OpenAI's `type`, `param` (the field at fault) and `code`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:  # noqa: A002 -- OpenAI's
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def client_closed(message: str) -> APIError:
    """A client that gave up (disconnected before its answer): counted as 499, never logged as the server's failure.
    Nobody reads the response."""
    return APIError(CLIENT_CLOSED, message, code="client_closed")


def overloaded(message: str) -> APIError:
    """A 503 for a full queue or a server that is stopping: come back in RETRY_AFTER_S seconds."""
    return APIError(503, message, code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})


def install(app: FastAPI, on_error: Callable[[int], None], guard: Callable[[Request], None] | None = None) -> None:
    """Every error of `app` in OpenAI's shape; `on_error(status)` counts each (the metrics). guard: checked before an
    unknown route or a wrong method is answered (raises `APIError`: the API key, so that a client without one learns
    nothing of the routes)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        on_error(error.status)
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        if guard is not None and error.status_code in (404, 405):
            try:
                guard(request)
            except APIError as refused:
                on_error(refused.status)
                return refused.response()
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(error.status_code, error.detail)
        on_error(error.status_code)
        return APIError(error.status_code, str(message), code=codes.get(error.status_code),
                        headers=getattr(error, "headers", None)).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        on_error(500)
        return APIError(500, f"the server failed: {type(error).__name__}: {error}").response()
