"""Tarpit ports rotated by a client, in header mode.

Any port of an allowed host is a valid `x-prefiller-host-port`, and breakers are per
host:port: a client naming ever new ports of an allowed host that accept and never answer
kept every one of their breakers closed, each request holding a connection until
--prefill-timeout. Now the failures of header-named ports that never answered 2xx are also
counted per host: past --breaker-failures, such ports of that host are refused without a
connection (503), while the pool members and the ports that have answered before are served
as ever (naming tarpit ports of a real pod's host cannot get the real pod blamed).

A real pdproc in process over gRPC, real HTTP pods and listening sockets on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.envoy_side import Outcome
from tests.waiting import eventually_async

from .conftest import CHAT_BYTES, SECONDS, Pd
from .pods import HostilePod
from .test_target_state import silent_listeners

THRESHOLD = 3  # --breaker-failures
TARPITS = 8  # ports that accept and never answer, each named once
# Longer than the test: no unproven port is let through as the breaker's half-open probe.
COOLDOWN_S = 120.0


@pytest.fixture
async def member() -> AsyncIterator[HostilePod]:
    """A pool member on the tarpits' host (its engine map is the host's: `pod`'s)."""
    pool_pod = await HostilePod("e0").start()
    yield pool_pod
    await pool_pod.close()


def prefills(pd: Pd) -> float:
    """Prefills pdproc finished, whatever their outcome: one per connection it made."""
    return pd.sample("pdproc_prefills_total")


async def name_at_once(pd: Pd, ports: list[int]) -> list[Outcome]:
    async with asyncio.timeout(SECONDS):
        return await asyncio.gather(
            *(pd.play(CHAT_BYTES, prefill=f"127.0.0.1:{port}") for port in ports)
        )


async def rotate(pd: Pd, ports: list[int]) -> None:
    """Each port named once: the first THRESHOLD at once are tried and time out; the
    others, on the same host, are refused at once and never connected to."""
    first = await name_at_once(pd, ports[:THRESHOLD])
    assert {(o.status, o.error_kind) for o in first} == {(504, "prefill_timeout")}
    assert pd.sample("pdproc_unproven_port_breakers_open") == 1
    tried = prefills(pd)
    rest = await name_at_once(pd, ports[THRESHOLD:])
    assert {(o.status, o.error_kind) for o in rest} == {(503, "prefill_unavailable")}
    assert rest[0].error is not None
    assert rest[0].error["message"] == (
        f"prefill target 127.0.0.1:{ports[THRESHOLD]} has never answered, and ports of "
        "127.0.0.1 that never answered are failing (circuit open)"
    )
    assert prefills(pd) == tried
    refused = len(ports) - THRESHOLD
    assert pd.sample("pdproc_unproven_port_refusals_total") == refused
    assert pd.sample("pdproc_requests_total", outcome="prefill_unavailable") == refused


async def assert_not_blamed(pd: Pd, pod: HostilePod, member: HostilePod) -> None:
    """The proven port and the pool member on that host are served, and not blamed."""
    assert (await pd.play(CHAT_BYTES, prefill=pod.address)).disaggregated
    assert (await pd.play(CHAT_BYTES, prefill=str(member.host_port()))).disaggregated
    assert (await pd.play(CHAT_BYTES)).disaggregated  # pool mode: the member
    assert member.hits["prefill"] == 2
    for target in (pod.host_port(), member.host_port()):
        assert not pd.service.breakers.is_open(target)
    assert await pd.series("pdproc_prefill_breaker_open") == []


async def assert_a_new_pod_passes_its_health_check(pd: Pd, fresh: HostilePod, tarpit: int) -> None:
    """A real pod on that host that has never served is refused once, and that refusal has
    its health endpoint asked in the background: it answers, so it is served from then on,
    long before the breaker's cooldown (COOLDOWN_S) would let any unproven port through. The
    host's breaker stays open: the tarpit port is still refused without a connection."""
    assert (await pd.play(CHAT_BYTES, prefill=fresh.address)).status == 503

    async def served() -> bool:
        return (await pd.play(CHAT_BYTES, prefill=fresh.address)).disaggregated

    await eventually_async(served, timeout_s=SECONDS, every_s=0.2)
    assert fresh.hits["other:/health"] >= 1, dict(fresh.hits)
    assert pd.sample("pdproc_unproven_port_breakers_open") == 1
    tried = prefills(pd)
    again = await name_at_once(pd, [tarpit])
    assert {(o.status, o.error_kind) for o in again} == {(503, "prefill_unavailable")}
    assert prefills(pd) == tried


async def test_rotating_tarpit_ports_open_the_hosts_unproven_breaker_only(
    pod: HostilePod, member: HostilePod, other_pod: HostilePod, make_pdproc: Any
) -> None:
    pd: Pd = await make_pdproc(
        pod,
        prefill=(member.host_port(),),
        breaker_failures=THRESHOLD,
        breaker_cooldown=COOLDOWN_S,
        prefill_timeout=1.0,
        max_named_host_connections=TARPITS,
    )
    # The pod named by the header answers once: it is proven.
    assert (await pd.play(CHAT_BYTES, prefill=pod.address)).disaggregated
    with silent_listeners(TARPITS) as listeners:
        ports = [sock.getsockname()[1] for sock in listeners]
        await rotate(pd, ports)
        await assert_not_blamed(pd, pod, member)
        await assert_a_new_pod_passes_its_health_check(pd, other_pod, ports[0])
