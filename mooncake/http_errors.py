"""OpenAI's error shape on the workers' HTTP API, {"error": {"message", "type", "param", "code"}},
for what their routes refuse and what FastAPI itself answers (validation, 404, a body over the
limit found while a route reads it). The conductor has its own handlers (conductor/errors.py);
the middleware's refusals use mooncake/auth.py's send_error, whose body this is too."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from mooncake.auth import error_json

log = logging.getLogger(__name__)


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> Response:
    return Response(error_json(status, message, code, param), status_code=status, media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        # A 400 naming the field, as the conductor answers (FastAPI's own is a 422 {"detail"}).
        first = (exc.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg", "invalid request"))
        return error_response(400, message, "invalid_value", param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
