"""OpenAI's error shape, {"error": {"message", "type", "param", "code"}}: the one body and type
table every HTTP server here answers errors with (conductor/errors.py, the middlewares' refusals
in mooncake/auth.py and mooncake/body_limit.py), and the workers' handlers for what their routes
refuse and what FastAPI itself answers (validation, 404, a body over the limit found while a
route reads it). The conductor has handlers of its own (conductor/errors.py)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_exceeded",
    500: "internal_error", 502: "upstream_error", 503: "service_unavailable", 504: "timeout",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": _printable(message), "type": kind, "param": _printable(param), "code": code}}


def _printable(text: str | None) -> str | None:
    """Text that encodes as UTF-8 (a message may quote the request, lone surrogates and all)."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_json(status: int, message: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, param, code)).encode()


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
