"""Ports that accept and never answer, named by a hostile client, cost that client only.

Header mode beside a pool: the client names ports of an allowed host (the pool pod's own
host) that accept a connection and never answer. pdproc's prefill connections are few
(8) and a header-named host may take 2 of them, so the tarpit never holds the connections
the pool's requests need: the healthy pool pod serves every other request, none of its
prefills is counted against it, and its breaker stays closed. The hostile requests end
`exhausted` (503) or `timeout` (504).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pdproc_sim import RunningPrefill

from pdproc.targets import HostPort

from .harness import Harness

PORTS = 8
HOSTILE = 24
VICTIMS = 12
BURST = 6


class Tarpit:
    """Listeners on loopback that accept and read, and never answer."""

    def __init__(self) -> None:
        self.servers: list[asyncio.Server] = []
        self.held: list[asyncio.StreamWriter] = []

    async def start(self, count: int) -> None:
        for _ in range(count):
            self.servers.append(await asyncio.start_server(self._hold, "127.0.0.1", 0))

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.held.append(writer)
        while await reader.read(65536):
            pass

    @property
    def ports(self) -> list[int]:
        return [server.sockets[0].getsockname()[1] for server in self.servers]

    async def close(self) -> None:
        for writer in self.held:
            writer.close()
        for server in self.servers:
            server.close()
            await server.wait_closed()


@pytest.fixture
async def tarpit() -> AsyncIterator[Tarpit]:
    pit = Tarpit()
    await pit.start(PORTS)
    yield pit
    await pit.close()


async def test_tarpit_ports_never_get_the_healthy_pool_pod_blamed(
    make_harness: Callable[..., Any], prefill: RunningPrefill, tarpit: Tarpit
) -> None:
    pool_pod = HostPort("127.0.0.1", prefill.port)
    h: Harness = await make_harness(
        prefill=(pool_pod,),
        max_prefill_connections=8,
        max_named_host_connections=2,
        prefill_timeout=3.0,
    )
    ports = tarpit.ports
    hostile = [
        asyncio.ensure_future(h.play(prefill=f"127.0.0.1:{ports[i % PORTS]}"))
        for i in range(HOSTILE)
    ]
    # The tarpit holds what it can get before the pool's requests arrive.
    await asyncio.sleep(0)
    victims = await asyncio.gather(*(h.play() for _ in range(VICTIMS)))
    attacked = await asyncio.gather(*hostile)
    assert all(v.disaggregated for v in victims), [v.status for v in victims]
    assert {a.status for a in attacked} <= {503, 504}, [a.status for a in attacked]
    assert h.sample("pdproc_prefills_total", outcome="2xx") == VICTIMS
    exhausted = h.sample("pdproc_prefills_total", outcome="exhausted")
    timeouts = h.sample("pdproc_prefills_total", outcome="timeout")
    assert exhausted + timeouts == HOSTILE
    assert timeouts >= 1  # the tarpit was reached: what it held was its own host's share
    assert h.service.breakers.allow(pool_pod)
    assert not h.service.breakers.is_open(pool_pod)
    assert h.sample("pdproc_prefill_breaker_open", target=str(pool_pod)) == 0


async def test_a_pod_that_answered_is_not_held_to_the_named_host_share(
    make_harness: Callable[..., Any], prefill: RunningPrefill
) -> None:
    """In header mode every pod is header-named. While a pod has never answered, its
    host's share (2 here) bounds it like a tarpit: of a burst of BURST, some are refused.
    Once it has answered a prefill 2xx it is a real pod, and a burst of BURST at it (the
    simulator's prefills take 50 ms, so they overlap) is served whole."""
    h: Harness = await make_harness(
        prefill=(), max_prefill_connections=16, max_named_host_connections=2
    )
    target = f"127.0.0.1:{prefill.port}"
    first = await asyncio.gather(*(h.play(prefill=target) for _ in range(BURST)))
    assert any(a.disaggregated for a in first)
    assert any(a.status == 503 for a in first), [a.status for a in first]
    exhausted = h.sample("pdproc_prefills_total", outcome="exhausted")
    later = await asyncio.gather(*(h.play(prefill=target) for _ in range(BURST)))
    assert all(a.disaggregated for a in later), [a.status for a in later]
    assert h.sample("pdproc_prefills_total", outcome="exhausted") == exhausted
