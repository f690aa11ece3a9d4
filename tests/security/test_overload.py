"""A burst of large bodies.

Envoy buffers each body (up to 16 MiB) and hands it to pdproc in one gRPC message; pdproc
then holds it (parsed, plus two rewritten copies) while it waits for the engine map.
Earlier, nothing bounded the sum: concurrent large prompts grew pdproc's memory without
limit. Now `--max-inflight-bytes` bounds the body bytes held across all streams: past it,
new P/D requests get 503 `overloaded` (the decode receives nothing), and the budget returns
to 0 when the burst is over.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest
from pdproc_sim.devstack import running_stack

from tests.stacks import records
from tests.waiting import eventually_async

from .conftest import CHAT_BYTES, SECONDS, SIM_ARGS, Pd, metric, send
from .pods import HostilePod, engine_map, gated

BUDGET = 1024 * 1024
LARGE = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 700_000}]})


async def test_bodies_beyond_the_budget_get_503_and_the_budget_returns_to_0(
    pod: HostilePod, make_pdproc: Any
) -> None:
    gate = asyncio.Event()
    pod.on_query = gated(engine_map({"0": {"engine_id": "e0"}}), gate)
    pd: Pd = await make_pdproc(pod, max_inflight_bytes=BUDGET)
    # The first large body is held while its engine map is looked up (the gate).
    first = asyncio.create_task(pd.play(LARGE, prefill=pod.address))
    await eventually_async(lambda: pd.sample("pdproc_request_body_bytes_in_flight") == len(LARGE))
    try:
        await assert_more_large_bodies_refused(pd, pod)
        # A small body still fits beside the held one.
        small = asyncio.create_task(pd.play(CHAT_BYTES, prefill=pod.address))
        await eventually_async(
            lambda: pd.sample("pdproc_request_body_bytes_in_flight") == len(LARGE) + len(CHAT_BYTES)
        )
    finally:
        gate.set()
    async with asyncio.timeout(SECONDS):
        assert (await first).disaggregated
        assert (await small).disaggregated
    assert pd.sample("pdproc_request_body_bytes_in_flight") == 0
    assert (
        pd.sample("pdproc_requests_total", path="/v1/chat/completions", outcome="overloaded") == 5
    )
    await assert_nothing_broke(pd, pod)


async def assert_more_large_bodies_refused(pd: Pd, pod: HostilePod) -> None:
    """More large bodies while the budget is held: P/D ones and ones the decode would serve
    alone, each a 503 `overloaded` that never reaches the decode."""
    refused = await asyncio.gather(
        *(pd.play(LARGE, prefill=pod.address) for _ in range(3)),
        *(pd.play(LARGE) for _ in range(2)),
    )
    for outcome in refused:
        assert (outcome.status, outcome.error_kind) == (503, "overloaded")
        assert outcome.decode_body is None


async def assert_nothing_broke(pd: Pd, pod: HostilePod) -> None:
    """The next large body is served, streams close, the budget is free."""
    assert (await pd.play(LARGE, prefill=pod.address)).disaggregated
    await eventually_async(lambda: pd.sample("pdproc_streams_active") == 0)
    assert pd.sample("pdproc_request_body_bytes_in_flight") == 0
    assert len(pd.service.breakers) == 0  # an overload is not the pod's fault


async def test_one_body_larger_than_the_budget_is_still_served_alone(
    pod: HostilePod, make_pdproc: Any
) -> None:
    """The budget bounds the sum, not a single body (that is --max-body-bytes' job)."""
    pd: Pd = await make_pdproc(pod, max_inflight_bytes=len(LARGE) // 2)
    assert (await pd.play(LARGE, prefill=pod.address)).disaggregated
    assert pd.sample("pdproc_request_body_bytes_in_flight") == 0


@pytest.mark.e2e
@pytest.mark.slow
def test_burst_of_large_bodies_through_envoy() -> None:
    """Four 700 KB requests at once through Envoy, with a 1 MiB budget and a bootstrap that
    takes 3 s to answer (a cold cache): the first body is held while the others arrive."""
    args = ["--max-inflight-bytes", str(BUDGET), "--shutdown-delay", "0", "--engine-refresh", "0"]
    with running_stack(SIM_ARGS, args) as stack:
        stack.sim_post("prefill", "/sim/faults", {"bootstrap_delay_s": 3.0})
        target = str(stack.sim.prefill)
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda _: send(stack, LARGE, target), range(4)))
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) <= {200, 503}, statuses
        assert 200 in statuses
        assert 503 in statuses
        for response in responses:
            if response.status_code == 503:
                assert response.headers["x-pdproc-error"] == "overloaded"
        assert len(records(stack, "decode")) == statuses.count(200)
        assert metric(stack, "pdproc_request_body_bytes_in_flight") == 0
        assert metric(stack, "pdproc_requests_total", outcome="overloaded") == statuses.count(503)
        # And afterwards the gateway is fine.
        stack.sim_post("prefill", "/sim/faults", {"clear": True})
        assert send(stack, CHAT_BYTES, target).status_code == 200
