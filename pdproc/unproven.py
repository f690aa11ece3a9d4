"""A breaker per host for the ports a header names that have never served a prefill.

Any port of an allowed host is a valid header target, and breakers are per host:port, so a
client rotating over many ports of an allowed host that accept and never answer would keep
every one of their breakers closed: each port fails a few times and is never named again.
So the failures of a header-named target that has not proven itself are also counted
against its host's "unproven ports" breaker (the same threshold and cooldowns as a pod's).
While it is open, a header-named target on that host that has not proven itself is refused
without a connection; after the cooldown one such request is let through as a probe.

Proven: a target whose prefill answered 2xx, remembered in a bounded LRU (`max_targets`).
Pool members and proven targets are never refused here, their failures are never counted
here, and their successes never close the host's breaker: naming tarpit ports of a real
pod's host cannot get the real pod blamed, and the pod's own answers cannot be used to keep
the tarpit's breaker closed. Only a target's first 2xx (it becomes proven) closes it.
A refused connection (`DOWN`) counts as one failure here, not as an open breaker at once:
a closed port costs pdproc nothing, and a host's real pods may sit beside closed ports.
A 4xx answer counts neither way (the port is up, but says nothing about the others).

A real pod can be unproven too: this process just started, or the pod is new. So that no
client can lock such a pod out by failing ports of its host, a target refused here gets one
background `GET /health` (at most `CHECKS_PER_HOST` at once per host and `MAX_CHECKS` in all; a
check that has run past `PREEMPT_AFTER_S` gives its place to a new one): a pod that answers 2xx
is proven and served from its next request on, while a port that accepts and never answers stays
refused. A client would have to name new such ports of one host faster than
CHECKS_PER_HOST / PREEMPT_AFTER_S (80 a second) to delay a never-served pod's check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from cachetools import LRUCache

from pdproc.breaker import CircuitBreakers
from pdproc.pod_verdict import Verdict
from pdproc.targets import HostPort

log = logging.getLogger(__name__)

CHECKS_PER_HOST = 8
MAX_CHECKS = 64
PREEMPT_AFTER_S = 0.1


def _host_key(target: HostPort) -> HostPort:
    """The key of a host's unproven-ports breaker: port 0, which no target can have."""
    return HostPort(target.host, 0)


class UnprovenPorts:
    def __init__(
        self,
        threshold: int,
        max_cooldown_s: float,
        *,
        is_member: Callable[[HostPort], bool],
        max_targets: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, bool], None] | None = None,
    ) -> None:
        self._is_member = is_member
        self._proven: LRUCache[HostPort, bool] = LRUCache(max_targets)
        # Set by the server once its HTTP client exists: is the target serving?
        self.health: Callable[[HostPort], Awaitable[Verdict]] | None = None
        self._checking: dict[HostPort, tuple[asyncio.Task[None], float]] = {}
        self._clock = clock
        self._on_change = on_change
        self._hosts = CircuitBreakers(
            threshold,
            max_cooldown_s,
            clock=clock,
            on_change=self._changed,
            max_targets=max_targets,
        )

    def unproven(self, target: HostPort) -> bool:
        """Named only by a header and never answered 2xx (as far as the LRU remembers)."""
        return not self._is_member(target) and target not in self._proven

    def allow(self, target: HostPort) -> bool:
        """May a request go to this target, as far as its host's unproven ports go? When
        the breaker is half-open, only the first unproven asker may."""
        if not self.unproven(target) or self._hosts.allow(_host_key(target)):
            return True
        self._check_later(target)
        return False

    def _check_later(self, target: HostPort) -> None:
        """Ask the refused target's health endpoint in the background (bounded)."""
        if self.health is None or target in self._checking:
            return
        same_host = [t for t in self._checking if t.host == target.host]
        if len(same_host) >= CHECKS_PER_HOST and not self._preempt(same_host):
            return
        if len(self._checking) >= MAX_CHECKS and not self._preempt(list(self._checking)):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._check(target, self.health))
        self._checking[target] = (task, self._clock())
        task.add_done_callback(lambda done: self._checked(target, done))

    def _checked(self, target: HostPort, task: asyncio.Task[None]) -> None:
        if self._checking.get(target, (None, 0.0))[0] is task:
            del self._checking[target]

    def _preempt(self, targets: list[HostPort]) -> bool:
        """Cancel the longest-running of these checks if it has run past PREEMPT_AFTER_S: a
        pod answers its health check in milliseconds, a port that accepts and never answers
        holds it until the timeout, so a client naming such ports cannot keep the checks busy
        and starve a real pod's."""
        oldest = min(targets, key=lambda t: self._checking[t][1])
        task, started = self._checking[oldest]
        if self._clock() - started < PREEMPT_AFTER_S:
            return False
        task.cancel()
        del self._checking[oldest]
        return True

    async def _check(
        self, target: HostPort, health: Callable[[HostPort], Awaitable[Verdict]]
    ) -> None:
        if await health(target) is Verdict.HEALTHY:
            self._proven[target] = True
            log.info(
                "prefill target %s answered its health check: served again although ports "
                "of its host that never answered are failing",
                target,
                extra={"prefill_target": str(target)},
            )

    def record(self, target: HostPort, verdict: Verdict) -> None:
        """What a prefill or a bootstrap query said about a target (pdproc.pod_verdict)."""
        if verdict in (Verdict.NOT_THE_POD, Verdict.REFUSED) or not self.unproven(target):
            if verdict is Verdict.HEALTHY and not self._is_member(target):
                self._proven[target] = True  # refreshes its place in the LRU
            return
        if verdict is Verdict.HEALTHY:
            self._proven[target] = True
            self._hosts.record(_host_key(target), Verdict.HEALTHY)
            return
        self._hosts.record(_host_key(target), Verdict.FAILED)

    def is_open(self, host: str) -> bool:
        return self._hosts.is_open(HostPort(host, 0))

    def forget_unasked(self) -> None:
        """Close the host breakers nobody asked about for a cooldown (see CircuitBreakers)."""
        self._hosts.forget_unasked()

    def __len__(self) -> int:
        """Hosts with unproven-port failures on record."""
        return len(self._hosts)

    def _changed(self, key: HostPort, is_open: bool) -> None:
        if is_open:
            log.warning(
                "prefill ports of %s that never answered are failing: such ports of it are "
                "refused without a connection until one answers (pool members and ports that "
                "answered before are not affected)",
                key.host,
                extra={"host": key.host},
            )
        if self._on_change is not None:
            self._on_change(key.host, is_open)
