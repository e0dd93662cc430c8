"""OpenAI-style errors: every failure the conductor reports has the same JSON shape.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mooncake.http_errors import error_body

log = logging.getLogger(__name__)

class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def invalid_value(loc: list[str], error: dict[str, Any]) -> APIError:
    """A pydantic validation error of the body's field at `loc`, as a 400 naming that field."""
    param = ".".join(loc) or None
    message = f"{param}: {error.get('msg')}" if param else str(error.get("msg", "invalid request"))
    return APIError(400, message, param=param, code="invalid_value")


def sse_error(err: APIError) -> str:
    """An error inside an event stream that has already started (status 200 is gone)."""
    return f"data: {json.dumps(err.body())}\n\n"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(400, f"request body is not valid JSON: {first.get('msg')}",
                                           code="invalid_json"), status_code=400)
        if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
            # JSON, but not an object (a list, a string): pydantic's words name no field to fix.
            return JSONResponse(error_body(400, "the request body must be a JSON object", code="invalid_value"),
                                status_code=400)
        return JSONResponse(invalid_value(loc, first).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # A bug of ours still answers in the API's shape (Starlette's own is a plain-text 500).
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}", code="internal_error"),
                            status_code=500)
