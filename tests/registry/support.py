"""Helpers shared by the registry tests (embedded HTTP and etcd back ends)."""

from __future__ import annotations

import asyncio
import time

from mooncake.registry import InstanceInfo


def info(iid: str, role: str = "prefill") -> InstanceInfo:
    return InstanceInfo(iid, role, f"http://127.0.0.1:1/{iid}", "127.0.0.1:2", "m", 16, 64, time.time())


def run(coro, timeout: float = 40.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def wait_until(pred, timeout: float = 5.0, what: str = "condition") -> float:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start
