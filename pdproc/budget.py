"""The in-flight byte budget (--max-inflight-bytes): request-body bytes this process holds.

It bounds memory, so it counts bytes pdproc really holds, never bytes a client only
announced, and until pdproc lets go of them. A buffered body is counted while it is
processed (Envoy hands it over whole). A streamed body (pdproc.streamed_body) is counted
chunk by chunk, as its bytes arrive, and until its end: a client that announces a large
content-length and then sends nothing holds nothing, so it cannot turn P/D off for everyone
else. Either stays counted until the prefill pod has read its prefill leg (views of it), so a
pod slow to read cannot make pdproc hold more than the budget.

The bound is on the sum. A single body larger than the budget is still admitted while
nothing else is held (bounding one body is --max-body-bytes' job).

Pure bookkeeping (the gauge is handed in): no I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class ByteBudget:
    def __init__(self, limit: int, on_change: Callable[[int], None] = lambda _: None) -> None:
        self.limit = limit
        self.held = 0
        self._on_change = on_change

    @property
    def full(self) -> bool:
        return self.held >= self.limit

    def take(self, size: int, *, own: int = 0) -> bool:
        """Hold `size` more bytes; False (nothing held) when that would pass the limit while
        others hold bytes. `own` is what the caller already holds (not the others')."""
        if self.held + size > self.limit and self.held - own > 0:
            return False
        self._set(self.held + size)
        return True

    def add(self, size: int) -> None:
        """Hold `size` more bytes whatever the level (bytes admitted already)."""
        self._set(self.held + size)

    def give_back(self, size: int) -> None:
        self._set(self.held - size)

    @contextlib.contextmanager
    def hold(self, size: int) -> Iterator[bool]:
        """Hold `size` bytes for the block; yields False (nothing held) when refused."""
        if not self.take(size):
            yield False
            return
        try:
            yield True
        finally:
            self.give_back(size)

    def holding(self) -> Holding:
        return Holding(self)

    def _set(self, held: int) -> None:
        self.held = held
        self._on_change(held)


class Holding:
    """What one streamed body holds: grows with each chunk, released once (at its end, on
    refusal, or when the stream ends)."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.bytes = 0

    def grow(self, size: int) -> bool:
        if not self._budget.take(size, own=self.bytes):
            return False
        self.bytes += size
        return True

    def keep(self, size: int) -> None:
        """Count `size` more bytes, unrefused: bytes already admitted that the request goes
        on holding (a sequential connector keeps the client's body until the prefill has
        answered)."""
        self._budget.add(size)
        self.bytes += size

    def release(self) -> None:
        if self.bytes:
            self._budget.give_back(self.bytes)
            self.bytes = 0
