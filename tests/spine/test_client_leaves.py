"""A non-streamed answer is cancelled when its client disconnects (conductor/app.py)."""

import asyncio

import pytest
from fastapi.responses import JSONResponse

from conductor.app import _unless_client_leaves


class FakeRequest:
    """Yields the ASGI messages a server would after the body was read."""

    def __init__(self, disconnect_after_s: float | None):
        self._after = disconnect_after_s

    async def receive(self):
        if self._after is None:
            await asyncio.Event().wait()  # the client never leaves
        await asyncio.sleep(self._after)
        return {"type": "http.disconnect"}


async def sleep_until_cancelled(cancelled: asyncio.Event) -> None:
    """Work that never ends by itself; records that it was cancelled."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        cancelled.set()
        raise


def run(coro):
    return asyncio.run(coro)


def test_the_answer_is_returned_when_the_client_stays():
    async def main():
        return await _unless_client_leaves(FakeRequest(None), asyncio.sleep(0.01, JSONResponse({"ok": 1})))
    assert run(main()).status_code == 200


def test_the_work_is_cancelled_when_the_client_leaves():
    cancelled = asyncio.Event()

    async def main():
        resp = await asyncio.wait_for(_unless_client_leaves(FakeRequest(0.01), sleep_until_cancelled(cancelled)), timeout=5)
        return resp, cancelled.is_set()
    resp, was_cancelled = run(main())
    assert resp.status_code == 499 and was_cancelled


def test_an_error_of_the_work_propagates():
    async def failing():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run(_unless_client_leaves(FakeRequest(None), failing()))


def test_cancelling_the_handler_cancels_the_work():
    cancelled = asyncio.Event()

    async def main():
        handler = asyncio.ensure_future(_unless_client_leaves(FakeRequest(None), sleep_until_cancelled(cancelled)))
        await asyncio.sleep(0.01)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        await asyncio.sleep(0)
        return cancelled.is_set()
    assert run(main())
