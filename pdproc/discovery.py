"""Prefill pods from DNS: a name (a Kubernetes headless Service) re-resolved periodically.

Every A/AAAA record is a pool member, so a scaling prefill Deployment needs no endpoint
picker. Each refresh replaces the set, so a pod that left the answer gets no prefill from
that refresh on. A failed or empty resolution keeps the last good set: a DNS hiccup must
not empty the pool while the pods are fine.

A lookup that hangs (a dead resolver: glibc retries for ~20 s) must not stretch the period:
each refresh waits at most `timeout_s` (shorter than the period), and the lookup still
running is reused by the next refresh instead of starting another, so a dead resolver holds
at most one resolver thread per name.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from pdproc.targets import HostPort

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Coroutine[Any, Any, Sequence[str]]]
# Told the outcome of every lookup: ok, empty, error or timeout.
LookupObserver = Callable[[str], None]

# Of the period: leaves the rest of it for the next refresh to start on time.
_TIMEOUT_SHARE = 0.8


async def system_resolver(name: str, port: int) -> list[str]:
    """Addresses of `name` from the system resolver (A and AAAA), deduplicated, in order."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    seen: dict[str, None] = {}
    for _family, _type, _proto, _canon, sockaddr in infos:
        seen.setdefault(str(sockaddr[0]), None)
    return list(seen)


def _ignore(_outcome: str) -> None:
    pass


class DnsPool:
    def __init__(
        self,
        names: Sequence[HostPort],
        refresh_s: float,
        resolver: Resolver = system_resolver,
        *,
        timeout_s: float | None = None,
        on_lookup: LookupObserver = _ignore,
        role: str = "prefill",
    ) -> None:
        self._role = role
        self._names = tuple(names)
        self._refresh_s = refresh_s
        longest = refresh_s * _TIMEOUT_SHARE
        self._timeout_s = longest if timeout_s is None else min(timeout_s, longest)
        self._resolver = resolver
        self._on_lookup = on_lookup
        self._members: dict[HostPort, tuple[HostPort, ...]] = {name: () for name in self._names}
        self._lookups: dict[HostPort, asyncio.Task[Sequence[str]]] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def members(self) -> tuple[HostPort, ...]:
        return tuple(m for members in self._members.values() for m in members)

    async def start(self) -> None:
        """Resolve once now (so the first requests have a pool), then keep refreshing."""
        await self.refresh()
        if self._names:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="dns-pool")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._lookups.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._lookups.clear()

    async def refresh(self) -> None:
        """Resolve every name at once, each bounded by the lookup timeout."""
        await asyncio.gather(*(self._refresh_one(name) for name in self._names))

    async def _refresh_one(self, name: HostPort) -> None:
        lookup = self._lookups.get(name)
        if lookup is None:
            lookup = asyncio.get_running_loop().create_task(
                self._resolver(name.host, name.port), name=f"dns-lookup {name}"
            )  # fmt: skip
            self._lookups[name] = lookup
        # wait(), not wait_for(): a lookup past the timeout keeps running for the next refresh.
        done, _ = await asyncio.wait({lookup}, timeout=self._timeout_s)
        if not done:
            self._failed(name, "timeout", f"no answer within {self._timeout_s:g} s")
            return
        del self._lookups[name]
        try:
            addresses = lookup.result()
        except (OSError, UnicodeError) as exc:
            self._failed(name, "error", str(exc))
            return
        members = tuple(HostPort(address.lower(), name.port) for address in addresses)
        if not members:
            self._failed(name, "empty", "no records")
            return
        self._on_lookup("ok")
        if set(members) != set(self._members[name]):
            log.info(
                "%s pool from DNS changed",
                self._role,
                extra={"dns_name": str(name), "members": [str(m) for m in members]},
            )
        self._members[name] = members

    def _failed(self, name: HostPort, outcome: str, why: str) -> None:
        self._on_lookup(outcome)
        log.warning(
            "%s DNS lookup failed (%s), keeping %d members: %s",
            self._role, outcome, len(self._members[name]), why,
            extra={"dns_name": str(name)},
        )  # fmt: skip

    async def _loop(self) -> None:
        # On a fixed schedule: a refresh never takes longer than its timeout, so a slow
        # resolver cannot push the next one back.
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += self._refresh_s
            await asyncio.sleep(max(0.0, due - loop.time()))
            due = max(due, loop.time() - self._refresh_s)
            await self.refresh()
