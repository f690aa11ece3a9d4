"""The pool routes around a failing member, through real gRPC to a real pdproc, with three
simulated prefill pods on three loopback addresses (one bootstrap port, as pods share one).

- equal idle members share sequential requests in equal turns;
- a member whose bootstrap server hangs costs no request: each that was sent to it moves
  to another member, the member's breaker opens, background probes find it back;
- a member that refuses connections costs the request in flight on it and no more: while
  it is down no client request is used to probe it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pdproc_sim import PrefillConfig, RunningPrefill, start_prefill
from pdproc_sim.devstack import free_port

from pdproc.config import PoolPolicy
from pdproc.targets import HostPort
from tests.waiting import eventually_async

from .harness import Harness

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


@pytest.fixture
async def pods() -> AsyncIterator[list[RunningPrefill]]:
    first = await start_prefill(PrefillConfig(host=HOSTS[0], dp_ranks=1))
    started = [first]
    try:
        for host in HOSTS[1:]:
            config = PrefillConfig(host=host, dp_ranks=1, bootstrap_port=first.bootstrap_port)
            started.append(await start_prefill(config))
        yield started
    finally:
        for pod in started:
            await pod.close()


def member(pod: RunningPrefill) -> HostPort:
    return HostPort(pod.host, pod.port)


async def pool_pdproc(
    make_harness: Callable[..., Any],
    members: list[HostPort],
    prefill: RunningPrefill,
    **settings: Any,
) -> Harness:
    h: Harness = await make_harness(
        **settings,
        prefill=tuple(members),
        mooncake_bootstrap_port=prefill.bootstrap_port,
        bootstrap_timeout=1.0,
        breaker_cooldown=2.0,
    )
    return h


def served_by(outcome: Any) -> str:
    """The host whose bootstrap address the decode was told: the prefill pod's."""
    params = outcome.kv_params
    assert params is not None, outcome
    address = str(params["remote_bootstrap_addr"])  # http://host:port
    return address.removeprefix("http://").rsplit(":", 1)[0]


@pytest.fixture
def prefill(pods: list[RunningPrefill]) -> RunningPrefill:
    return pods[0]  # what the shared harness fixture's settings start from


async def test_equal_members_share_sequential_requests(
    make_harness: Callable[..., Any], pods: list[RunningPrefill]
) -> None:
    # Equal turns are the least-loaded policy's; the prefix policy (the default) keeps a
    # repeated prompt on the member that holds it.
    least = PoolPolicy.LEAST_LOADED
    h = await pool_pdproc(make_harness, [member(p) for p in pods], pods[0], pool_policy=least)
    hosts = Counter()
    for _ in range(60):
        outcome = await h.play()
        assert outcome.disaggregated, outcome
        hosts[served_by(outcome)] += 1
    assert set(hosts) == set(HOSTS)
    assert min(hosts.values()) >= 15, hosts  # each of 3 at least 25 %


async def test_a_hanging_bootstrap_server_costs_no_request(
    make_harness: Callable[..., Any], pods: list[RunningPrefill]
) -> None:
    # Least-loaded turns send requests to every member, the hanging one included (the
    # prefix policy would keep this one repeated prompt on its home, which may not be it).
    least = PoolPolicy.LEAST_LOADED
    h = await pool_pdproc(make_harness, [member(p) for p in pods], pods[0], pool_policy=least)
    pods[1].state.faults.bootstrap_delay_s = 30.0  # its /query never answers in time
    outcomes = [await h.play() for _ in range(30)]
    assert all(o.disaggregated for o in outcomes), [o.status for o in outcomes]
    assert HOSTS[1] not in {served_by(o) for o in outcomes}
    assert h.sample("pdproc_bootstrap_reroutes_total") >= 1
    assert h.service.breakers.is_open(member(pods[1]))
    pods[1].state.faults.bootstrap_delay_s = None
    await eventually_async(lambda: not h.service.breakers.is_open(member(pods[1])))
    assert h.sample("pdproc_prefill_probes_total", result="up") >= 1


async def test_a_member_that_refuses_connections_is_probed_by_pdproc_not_by_clients(
    make_harness: Callable[..., Any], pods: list[RunningPrefill]
) -> None:
    closed = HostPort(HOSTS[0], free_port())  # its host's bootstrap server answers
    # Least-loaded turns reach the closed member (the prefix policy would keep this one
    # repeated prompt on its home, which may be the open one).
    least = PoolPolicy.LEAST_LOADED
    h = await pool_pdproc(make_harness, [member(pods[0]), closed], pods[0], pool_policy=least)
    outcomes = [await h.play() for _ in range(8)]
    failed = [o for o in outcomes if not o.disaggregated]
    assert len(failed) <= 1  # the one in flight on it when it was found down
    assert h.service.breakers.is_open(closed)
    # Cooldowns pass (2 s at most here) while requests keep coming: none is the probe.
    await eventually_async(
        lambda: h.sample("pdproc_prefill_probes_total", result="down") >= 2, timeout_s=30
    )
    later = [await h.play() for _ in range(8)]
    assert all(o.disaggregated for o in later), [o.status for o in later]
    assert h.sample("pdproc_prefills_total", outcome="connect_error") == len(failed)
