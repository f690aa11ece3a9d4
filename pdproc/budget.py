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

Pure bookkeeping (the gauge is handed in): no I/O. One handle per body (`BodyBytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio


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

    def give_back(self, size: int) -> None:
        self._set(self.held - size)

    def body(self) -> BodyBytes:
        """The handle of one request body's bytes."""
        return BodyBytes(self)

    def _set(self, held: int) -> None:
        self.held = held
        self._on_change(held)


class BodyBytes:
    """One request body's bytes against the budget, the one handle for them: taken as they
    arrive (refused past the limit), held by the request and by whoever it hands them on to
    (the decode leg still to be built from them, the prefill leg still being sent), and
    released once, when the last of these lets go."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.bytes = 0
        self._holders = 1  # the request
        self._request_let_go = False

    def take(self, size: int) -> bool:
        """Count `size` more bytes of the body; False (nothing counted) when the budget is
        full with others' bytes."""
        if not self._budget.take(size, own=self.bytes):
            return False
        if self._request_let_go:
            # Bytes after the request let go (a message Envoy had already sent): the
            # request holds them again, to let go of at its end.
            self._request_let_go = False
            self._holders += 1
        self.bytes += size
        return True

    def share(self) -> Callable[[], None]:
        """One more holder of the bytes; the function returned lets go of them (once)."""
        self._holders += 1
        done = False

        def let_go() -> None:
            nonlocal done
            if not done:
                done = True
                self._let_go()

        return let_go

    def until(self, done: asyncio.Future[None] | None) -> None:
        """The bytes stay counted until `done` is (views of them still being written)."""
        if done is None or done.done():
            return
        let_go = self.share()
        done.add_done_callback(lambda _: let_go())

    def release(self) -> None:
        """The request lets go (again: nothing): the bytes leave the budget unless another
        holder still has them."""
        if not self._request_let_go:
            self._request_let_go = True
            self._let_go()

    def _let_go(self) -> None:
        self._holders -= 1
        if self._holders == 0 and self.bytes:
            self._budget.give_back(self.bytes)
            self.bytes = 0
