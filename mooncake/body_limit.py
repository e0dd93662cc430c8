"""A request body size limit for every HTTP server of the cluster (conductor and workers).

A body over the limit is refused with 413 in OpenAI's error shape: at once when its
Content-Length says so, or as soon as a chunked body passes the limit while it is read, so a
client cannot make a server buffer an unbounded body.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException

from mooncake.auth import header, send_error


class BodyLimitMiddleware:
    """ASGI middleware: refuses request bodies over `max_bytes` with 413."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = header(scope, "content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        seen = 0
        started = False

        async def counting_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _BodyTooLarge(413, f"request body is larger than {self.max_bytes} bytes")
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:  # a streamed answer already under way cannot change its status
                await self._too_large(send)

    async def _too_large(self, send) -> None:
        await send_error(send, 413, f"request body is larger than {self.max_bytes} bytes", "request_too_large")


class _BodyTooLarge(HTTPException):
    """The request body passed the size limit while it was being read. An HTTPException, so that
    FastAPI's body parsing passes it on as a 413 (it turns other errors into a 400), and the app's
    own handlers answer it in their error shape."""
