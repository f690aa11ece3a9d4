"""pdproc's own connections to prefill pods: a bound in all, and a tighter one per host for
targets a request header names.

A prefill waits for a free connection before its pod's `--prefill-timeout` starts, and a
wait that outlasts its bound is pdproc's exhaustion (`exhausted`), never the pod's failure:
a client that names ports which accept and never answer fills pdproc's connections, not a
healthy pod's record. Targets a header names (any port of an allowed host) that have
never answered a prefill share one per-host bound that pool members and proven pods do not
count against, so such a client cannot take more than that many of them: past it, its own
requests are refused at once, while a real pod serves as many as its traffic needs.
"""

from __future__ import annotations

import asyncio
from collections import Counter


class Slots:
    def __init__(self, total: int, per_named_host: int) -> None:
        self._free = asyncio.Semaphore(max(1, total))
        self._per_named_host = max(1, per_named_host)
        self._named: Counter[str] = Counter()

    async def take(self, named_host: str | None, wait_s: float) -> bool:
        """Take a connection slot, waiting at most `wait_s` for one; False when none came.
        `named_host`: the host of a target a request header named (not a pool member)."""
        if named_host is not None:
            if self._named[named_host] >= self._per_named_host:
                return False
            self._named[named_host] += 1
        if not self._free.locked():
            # A free slot is taken without waiting: no timer for the usual case.
            await self._free.acquire()
            return True
        try:
            async with asyncio.timeout(wait_s):
                await self._free.acquire()
        except TimeoutError:
            self._drop_named(named_host)
            return False
        except asyncio.CancelledError:
            self._drop_named(named_host)
            raise
        return True

    def give_back(self, named_host: str | None) -> None:
        self._free.release()
        self._drop_named(named_host)

    def _drop_named(self, named_host: str | None) -> None:
        if named_host is None:
            return
        self._named[named_host] -= 1
        if self._named[named_host] <= 0:
            del self._named[named_host]
