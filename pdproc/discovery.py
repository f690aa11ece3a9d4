"""Prefill pods from DNS: a name (a Kubernetes headless Service) re-resolved periodically.

Every A/AAAA record is a pool member, so a scaling prefill Deployment needs no endpoint
picker. A failed or empty resolution keeps the last good set: a DNS hiccup must not empty
the pool while the pods are fine.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

from pdproc.targets import HostPort

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


async def system_resolver(name: str, port: int) -> list[str]:
    """Addresses of `name` from the system resolver (A and AAAA), deduplicated, in order."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    seen: dict[str, None] = {}
    for _family, _type, _proto, _canon, sockaddr in infos:
        seen.setdefault(str(sockaddr[0]), None)
    return list(seen)


class DnsPool:
    def __init__(
        self,
        names: Sequence[HostPort],
        refresh_s: float,
        resolver: Resolver = system_resolver,
    ) -> None:
        self._names = tuple(names)
        self._refresh_s = refresh_s
        self._resolver = resolver
        self._members: dict[HostPort, tuple[HostPort, ...]] = {name: () for name in self._names}
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
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def refresh(self) -> None:
        for name in self._names:
            try:
                addresses = await self._resolver(name.host, name.port)
            except OSError as exc:
                kept = len(self._members[name])
                log.warning(
                    "prefill DNS lookup failed, keeping %d members: %s", kept, exc,
                    extra={"dns_name": str(name)},
                )  # fmt: skip
                continue
            members = tuple(HostPort(address.lower(), name.port) for address in addresses)
            if not members:
                continue
            if set(members) != set(self._members[name]):
                log.info(
                    "prefill pool from DNS changed",
                    extra={"dns_name": str(name), "members": [str(m) for m in members]},
                )
            self._members[name] = members

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            await self.refresh()
