"""Several streams of one request's choices read as one: each event as it comes, tagged with its
stream's index (`n` prompts of a batched completion, conductor/serving.py's `sse`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from conductor.choices import ChoiceEvent

_END = object()


async def merged(streams: list[AsyncIterator[ChoiceEvent]]) -> AsyncIterator[tuple[int, ChoiceEvent]]:
    """(k, event) from each of the streams as its events come. One stream is read as it is (no
    task per token); several are each read by one pending task at a time, and what is left
    pending is cancelled when the merge ends, however it ends."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    pending = {asyncio.ensure_future(anext(s, _END)): k for k, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                k = pending.pop(task)
                event = task.result()  # a worker's failure is raised here
                if event is not _END:
                    yield k, event
                    pending[asyncio.ensure_future(anext(streams[k], _END))] = k
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
