"""Ask a conductor where its prefix index places a prompt (POST /internal/debug/prefix).

Tests that need the index to know particular blocks wait for those blocks by name: the index's
size is no signal, since other blocks may leave it at the same time (pool and engine evictions).
"""

from __future__ import annotations

import time

import httpx


def cached_blocks(conductor: str, headers: dict[str, str], prompt: list[int] | str, worker: str) -> int:
    """The blocks of `prompt`'s prefix (token ids, or text a completion would tokenize) that the
    conductor at `conductor` (its base URL) places on `worker` (its URL or instance id)."""
    resp = httpx.post(conductor + "/internal/debug/prefix", json={"prompt": prompt}, headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    return next((i["cached_blocks"] for i in resp.json()["instances"] if worker in (i["url"], i["instance"])), 0)


def wait_cached(conductor: str, headers: dict[str, str], prompt: list[int] | str, worker: str, blocks: int,
                timeout_s: float = 30.0) -> None:
    """Until the index places at least `blocks` of `prompt`'s prefix on `worker` (the KV events
    are long-polled: at once, but asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (held := cached_blocks(conductor, headers, prompt, worker)) < blocks:
        assert time.monotonic() < deadline, (
            f"after {timeout_s:.0f} s the prefix index places {held} of {blocks} blocks on {worker}")
        time.sleep(0.2)
