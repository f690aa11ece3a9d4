"""Unbounded per-target state from client-chosen ports.

Any port of an allowed host is an allowed target (as in llm-d), so whoever can set
`x-prefiller-host-port` chooses from 65,535 targets per host. Earlier, every target got
a breaker, `/metrics` series of its own and an engine-cache entry (one `/query` per port):
state and scrape size grew with what clients sent. Now breakers and per-target series are
bounded by `--max-targets` (least recently used forgotten) and the engine cache is keyed by
host.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

from tests.envoy_side import Outcome
from tests.waiting import eventually_async

from .conftest import CHAT_BYTES, SECONDS, Pd
from .pods import HostilePod, engine_map, gated

MAX_TARGETS = 50
PORTS = 300


def closed_ports(count: int) -> list[int]:
    """Ports nothing listens on (just released by the kernel: connection refused)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@contextlib.contextmanager
def silent_listeners(count: int) -> Iterator[list[socket.socket]]:
    """Ports that accept connections (in the kernel's backlog) and never answer."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
            sock.listen(8)
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


async def burst(pd: Pd, pod: HostilePod, ports: list[int]) -> list[Outcome]:
    """One request per port, all with their bodies inside pdproc before the (gated)
    bootstrap answers: every one of them needs the engine map of the same host."""
    gate = asyncio.Event()
    pod.on_query = gated(engine_map({"0": {"engine_id": "e0"}}), gate)
    tasks = [
        asyncio.create_task(pd.play(CHAT_BYTES, prefill=f"127.0.0.1:{port}")) for port in ports
    ]
    try:
        # Every body is held (counted in the in-flight budget) while it waits for the map.
        held = len(ports) * len(CHAT_BYTES)
        await eventually_async(lambda: pd.sample("pdproc_request_body_bytes_in_flight") == held)
        gate.set()
        async with asyncio.timeout(SECONDS):
            return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def assert_refusing_ports_leave_bounded_breakers(
    pd: Pd, pod: HostilePod, refusing: list[int]
) -> None:
    """Ports nothing listens on, named at once: one /query for the host, and each refused
    connection opens its target's breaker; the breaker table stays bounded."""
    outcomes = await burst(pd, pod, refusing)
    assert {(o.status, o.error_kind) for o in outcomes} == {(502, "prefill_failed")}
    assert pod.hits["query"] == 1
    assert 0 < len(pd.service.breakers) <= MAX_TARGETS
    open_series = await pd.series("pdproc_prefill_breaker_open")
    assert 0 < len(open_series) <= MAX_TARGETS


async def assert_silent_ports_leave_bounded_series(
    pd: Pd, pod: HostilePod, listeners: list[socket.socket]
) -> list[Outcome]:
    """Ports that accept and never answer: prefills in flight to all of them at once; the
    per-target gauge stays bounded, and the host's map serves every port. Closing the
    listeners ends them; their outcomes."""
    running = [
        asyncio.create_task(pd.play(CHAT_BYTES, prefill=f"127.0.0.1:{sock.getsockname()[1]}"))
        for sock in listeners
    ]
    try:
        await eventually_async(lambda: pd.sample("pdproc_prefills_in_flight") == PORTS)
        in_flight = await pd.series("pdproc_prefills_in_flight")
        assert 0 < len(in_flight) <= MAX_TARGETS + 1  # plus the shared "other" series
        total = sum(pd.sample("pdproc_prefills_in_flight", **s) for s in in_flight)
        assert total == PORTS
        assert pod.hits["query"] == 1  # one /query for 600 ports of one host
    finally:
        for sock in listeners:
            sock.close()  # resets the waiting connections: every prefill fails at once
        async with asyncio.timeout(SECONDS):
            outcomes = await asyncio.gather(*running)
    return outcomes


async def test_client_chosen_ports_leave_bounded_state_and_one_query(
    pod: HostilePod, make_pdproc: Any
) -> None:
    # Every port's prefill must run for the state to be tested: the per-host connection
    # share (tests/integration/test_tarpit.py) would refuse most of them first, and the
    # host's unproven-ports breaker (tests/security/test_unproven_ports.py) the silent ones
    # after the refused ones; its threshold is the pod breakers', so set past 600 failures.
    pd: Pd = await make_pdproc(
        pod,
        max_targets=MAX_TARGETS,
        max_named_host_connections=PORTS,
        breaker_failures=3 * PORTS,
    )
    with silent_listeners(PORTS) as listeners:
        # Taken while the listeners hold theirs: the two sets of ports cannot overlap.
        refusing = closed_ports(PORTS)
        await assert_refusing_ports_leave_bounded_breakers(pd, pod, refusing)
        outcomes = await assert_silent_ports_leave_bounded_series(pd, pod, listeners)
    assert {o.status for o in outcomes} == {502}
    assert 0 < len(pd.service.breakers) <= MAX_TARGETS
    await eventually_async(lambda: pd.sample("pdproc_prefills_in_flight") == 0)
    left = await pd.series("pdproc_prefills_in_flight")
    assert left in ([], [{"target": "other"}])  # only the shared series may stay, at 0
    assert pd.sample("pdproc_prefills_in_flight", target="other") == 0
    # The pod itself is still served.
    pod.on_query = engine_map({"0": {"engine_id": "e0"}})
    assert (await pd.play(CHAT_BYTES, prefill=pod.address)).disaggregated


async def test_failures_on_client_chosen_ports_do_not_thrash_the_engine_cache(
    pod: HostilePod, make_pdproc: Any
) -> None:
    """Found by this suite: a refused connection to any port of a host used to drop the
    host's engine-id map, so a client naming closed ports of an allowed prefill host cost
    one bootstrap /query per request and every other user a cache miss. A port that refuses
    connections says nothing about the host's bootstrap server."""
    pd: Pd = await make_pdproc(pod, max_targets=MAX_TARGETS)
    assert (await pd.play(CHAT_BYTES, prefill=pod.address)).disaggregated
    assert pod.hits["query"] == 1
    answers = []
    for port in closed_ports(20):
        outcome = await pd.play(CHAT_BYTES, prefill=f"127.0.0.1:{port}")
        answers.append((outcome.status, outcome.error_kind))
    # After --breaker-failures (5) of them, the host's ports that never answered are refused
    # without a connection; the pod, which has answered, is not.
    assert answers == [(502, "prefill_failed")] * 5 + [(503, "prefill_unavailable")] * 15
    assert (await pd.play(CHAT_BYTES, prefill=pod.address)).disaggregated
    # Nothing about the bootstrap server (the only source of the map) has changed.
    assert pod.hits["query"] == 1, f"{pod.hits['query']} /query for one host"
