"""The engine-id cache against a real (simulated) bootstrap server: no pairing uses a map
that may be stale, and a query that found new ids serves every request waiting on it.

The clock is injected so ages are exact; the HTTP is real."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx
import pytest
from pdproc_sim import PrefillConfig, RunningPrefill, start_prefill

from pdproc.engine_maps import MIN_REFETCH_S, EngineMaps
from pdproc.metrics import Metrics
from pdproc.multiprocess.siblings import Siblings
from pdproc.pod_http import new_session
from pdproc.targets import HostPort

MAX_AGE = 15.0
REFRESH = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def pod() -> AsyncIterator[RunningPrefill]:
    running = await start_prefill(PrefillConfig(dp_ranks=2))
    yield running
    await running.close()


@pytest.fixture
async def maps(pod: RunningPrefill) -> AsyncIterator[tuple[EngineMaps, Clock]]:
    clock = Clock()
    assert pod.bootstrap_port is not None
    async with new_session(16) as client:
        yield (
            EngineMaps(
                client,
                Metrics(),
                port=pod.bootstrap_port,
                timeout_s=5.0,
                max_age_s=MAX_AGE,
                size=16,
                refresh_s=REFRESH,
                clock=clock,
            ),
            clock,
        )


def target(pod: RunningPrefill) -> HostPort:
    return HostPort(pod.host, pod.port)


async def restart(pod: RunningPrefill) -> dict[int, str]:
    async with httpx.AsyncClient() as client:
        answer = (await client.post(pod.url + "/sim/restart")).json()
    return {int(rank): engine for rank, engine in answer["engine_ids"].items()}


async def queries(pod: RunningPrefill) -> int:
    async with httpx.AsyncClient() as client:
        count: int = (await client.get(pod.url + "/sim/stats")).json()["bootstrap_queries"]
    return count


async def test_a_map_past_its_age_is_queried_again_before_any_request_uses_it(
    pod: RunningPrefill, maps: tuple[EngineMaps, Clock]
) -> None:
    """The first request after an idle spell longer than a restart gets the new ids, not the
    map it would have been handed while a background query ran (stale-while-revalidate)."""
    engines, clock = maps
    before = await engines.get(target(pod))
    new = await restart(pod)
    assert new != before
    clock.now += MAX_AGE  # the pod was down (no traffic) longer than the map may live
    assert await engines.get(target(pod)) == new
    assert await queries(pod) == 2


async def test_every_request_waiting_on_a_query_gets_its_answer(
    pod: RunningPrefill, maps: tuple[EngineMaps, Clock]
) -> None:
    engines, clock = maps
    await engines.get(target(pod))
    new = await restart(pod)
    clock.now += MAX_AGE + 1
    # Twenty requests arrive together: one query, and all of them pair with its answer.
    got = await asyncio.gather(*(engines.get(target(pod)) for _ in range(20)))
    assert got == [new] * 20
    assert await queries(pod) == 2


async def test_a_young_map_is_used_and_refreshed_in_the_background(
    pod: RunningPrefill, maps: tuple[EngineMaps, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    engines, clock = maps
    old = await engines.get(target(pod))
    new = await restart(pod)
    clock.now += REFRESH + 1  # younger than MAX_AGE: it cannot be stale (restarts take longer)
    assert await engines.get(target(pod)) == old
    for _ in range(200):  # bounded: the background query is one loopback round trip
        if await queries(pod) == 2:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0)
    assert await engines.get(target(pod)) == new
    # Ids that changed this fast break the design's assumption: the operator is told.
    assert "restarted faster than --engine-cache-ttl assumes" in caplog.text


async def test_a_prefetch_starts_a_query_for_a_map_too_old_to_use(
    pod: RunningPrefill, maps: tuple[EngineMaps, Clock]
) -> None:
    engines, clock = maps
    await engines.get(target(pod))
    new = await restart(pod)
    clock.now += MAX_AGE
    engines.prefetch(target(pod))
    assert await engines.get(target(pod)) == new
    assert await queries(pod) == 2  # the request waited for the prefetch, no second query


def sibling_maps(
    client: aiohttp.ClientSession, pod: RunningPrefill, clock: Clock, shared: Path
) -> EngineMaps:
    """The engine maps of one worker of a pdproc whose workers share `shared`."""
    return EngineMaps(
        client,
        Metrics(),
        port=pod.bootstrap_port or 0,
        timeout_s=5.0,
        max_age_s=MAX_AGE,
        size=16,
        clock=clock,
        siblings=Siblings(str(shared)),
    )


async def test_workers_follow_a_map_another_worker_dropped(
    pod: RunningPrefill, tmp_path: Path
) -> None:
    """Two workers of one pdproc (--workers), each with its own cache: the pod restarted
    faster than the age bound and failed a prefill in one of them. The other does not pair
    with its (young, stale) map either."""
    clock = Clock()
    async with new_session(16) as client:
        first, second = (sibling_maps(client, pod, clock, tmp_path / "shared") for _ in range(2))
        old = await first.get(target(pod))
        assert await second.get(target(pod)) == old
        clock.now += MIN_REFETCH_S + 0.5
        new = await restart(pod)
        first.invalidate(target(pod))  # its prefill failed
        assert await second.get(target(pod)) == new
        assert await first.get(target(pod)) == new
        assert await queries(pod) == 4  # one each before, one each after


async def test_workers_follow_a_map_another_worker_found_changed(
    pod: RunningPrefill, tmp_path: Path
) -> None:
    """The pod restarted faster than the age bound, and one worker's query (a probe) found
    its new ids: the other worker does not pair with its young old map, and the worker that
    found the change keeps the new map its own mark came with."""
    clock = Clock()
    async with new_session(16) as client:
        first, second = (sibling_maps(client, pod, clock, tmp_path / "shared") for _ in range(2))
        old = await first.get(target(pod))
        assert await second.get(target(pod)) == old
        new = await restart(pod)
        assert await first.query_now(target(pod)) == new
        assert await first.get(target(pod)) == new
        assert await queries(pod) == 3  # the new map is used as it is, not asked for again
        assert await second.get(target(pod)) == new
        assert await queries(pod) == 4
