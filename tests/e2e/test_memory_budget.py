"""`--max-inflight-bytes` bounds pdproc's real memory, not only the body bytes it counts.

The deployments size the budget as (memory limit - 256 MiB) / 4: memory must stay within 4x
the budget (held bodies cost 1.1-1.7x their size, scripts/measure_memory.py; a burst refused
at the budget adds gRPC's buffers for the refused streams: 2.3-2.9x measured here). More long
prompts arrive at once than the budget admits, each held by a slow prefill: some are served,
the rest refused with 503, and pdproc's resident memory grows by at most 4x the budget. A
body that leaves the budget while pdproc still holds it, or a copy too many, breaks it."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
from pdproc_sim.devstack import PeakMemory, resident_bytes, running_stack

MiB = 1 << 20
BUDGET = 48 * MiB
BODY_MIB = 4
CLIENTS = 24  # 96 MiB offered against the 48 MiB budget
# The base Deployment's planning factor (deploy/tools/deploycheck/checks.py).
PLANNED_FACTOR = 4


def long_prompt() -> bytes:
    prompt = "tok " * (BODY_MIB * MiB // 4)
    return orjson.dumps({"model": "sim-model", "max_tokens": 2, "prompt": prompt})


def post_all(url: str, body: bytes) -> list[int]:
    headers = {"content-type": "application/json"}

    def one(_: int) -> int:
        with httpx.Client(timeout=60) as client:
            return client.post(url, content=body, headers=headers).status_code

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, range(CLIENTS)))


@pytest.fixture(params=["nixlv2", "mooncake"])
def held(request: pytest.FixtureRequest) -> Iterator[tuple[str, int, str]]:
    """A stack whose prefill takes 3 s: Envoy's URL, pdproc's pid and the connector. NIXL v2
    holds each body until its prefill answers; Mooncake streams bodies of this size and
    holds each until the prefill pod has read it."""
    sim = ["--prefill-delay-ms", "3000", "--itl-ms", "1"]
    limits = ["--max-inflight-bytes", str(BUDGET), "--max-body-bytes", str(8 * MiB)]
    with running_stack(
        sim,
        limits,
        pool=True,
        kv_connector=request.param,
        envoy_options={"max_body_bytes": 8 * MiB},
    ) as stack:
        url = stack.envoy.url + "/v1/completions"
        with httpx.Client(timeout=60) as client:  # connections, caches and imports warmed
            assert client.post(url, json={"model": "sim-model", "prompt": "x"}).status_code == 200
        yield url, stack.pdproc.popen.pid, request.param


def test_the_inflight_budget_bounds_resident_memory(held: tuple[str, int, str]) -> None:
    url, pid, connector = held
    body = long_prompt()
    time.sleep(0.5)  # let the warm-up's memory settle before the baseline is read
    idle = resident_bytes(pid)
    with PeakMemory(pid) as memory:
        statuses = post_all(url, body)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 2, statuses  # the budget admitted some...
    if connector == "nixlv2":  # ...and, with every admitted body held for 3 s, refused more
        assert statuses.count(503) >= 1, statuses
    grown = memory.peak - idle
    assert grown <= PLANNED_FACTOR * BUDGET, (
        f"pdproc grew by {grown / MiB:.0f} MiB for a {BUDGET / MiB:.0f} MiB budget "
        f"({statuses.count(200)} of {CLIENTS} bodies of {BODY_MIB} MiB admitted)"
    )
