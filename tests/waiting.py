"""The one way every suite waits for state that other tasks or processes reach: poll a check,
bounded by a timeout that is a bound, never a measurement (the machine is shared and slow).

`eventually` for synchronous tests (subprocesses, containers, engines), `eventually_async`
for tests running on the event loop (an in-process pdproc), whose check may be a coroutine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def eventually(
    check: Callable[[], Any], timeout_s: float = 15.0, every_s: float = 0.05, what: str = ""
) -> Any:
    """Poll `check` until it returns something true, and return that; fail after `timeout_s`
    naming `what` (or the check)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or check}: not reached in {timeout_s} s")
        time.sleep(every_s)


async def eventually_async(
    check: Callable[[], Any], timeout_s: float = 20.0, every_s: float = 0.01
) -> Any:
    """The same on the event loop (the check may return an awaitable)."""
    async with asyncio.timeout(timeout_s):
        while True:
            value = check()
            if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
                value = await value
            if value:
                return value
            await asyncio.sleep(every_s)
