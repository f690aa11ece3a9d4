"""`--workers 2`: the shared /metrics page tells the truth about the per-target gauges.

Each worker writes its values to prometheus_client's per-process files, which keep every
series ever written. Before: a finished target's `pdproc_prefills_in_flight` kept its last
value (it read 10 with nothing in flight), a closed breaker stayed 1 (the breaker alert
would fire forever), `--max-targets` held per process only (202 series for a limit of 20),
and each removal warned that label removal is not implemented in multi-process mode.

Envoy opens a connection per request, so the requests spread over both workers.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
from pdproc_sim.devstack import Stack, running_stack
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import eventually

from .conftest import one_stream_per_connection

pytestmark = pytest.mark.e2e

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
MAX_TARGETS = 5
REFUSED_PORTS = 24
HELD = 6
MAX_REQUESTS = 400  # bound of each loop below


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # A breaker's first cooldown is 1 s whatever --breaker-cooldown says; 30 s keeps an open
    # breaker nobody asks about from being forgotten while a test looks at it.
    args = ["--workers", "2", "--max-targets", str(MAX_TARGETS), "--breaker-failures", "1",
            "--breaker-cooldown", "30", "--prefill-timeout", "30",
            "--prefill-allow", "127.0.0.0/8"]  # fmt: skip
    with running_stack(
        ["--itl-ms", "1"],
        args,
        workdir=tmp_path_factory.mktemp("workers"),
        envoy_config_hook=one_stream_per_connection,
    ) as st:
        yield st


def series(stack: Stack, family: str) -> dict[str, float]:
    """The page's samples of a per-target family, by target."""
    page = stack.metrics_text()
    return {
        sample.labels["target"]: sample.value
        for metrics in text_string_to_metric_families(page)
        if metrics.name == family
        for sample in metrics.samples
    }


def post(stack: Stack, target: str) -> int:
    response = httpx.post(
        stack.envoy.url + "/v1/chat/completions",
        json=CHAT,
        headers={"x-prefiller-host-port": target},
        timeout=60,
    )
    return response.status_code


def test_prefills_in_flight_is_the_sum_of_the_workers_and_nothing_after(stack: Stack) -> None:
    pod = str(stack.sim.prefill)
    stack.sim_post("prefill", "/sim/faults", {"prefill_hang": True})
    with ThreadPoolExecutor(HELD) as pool:
        answers = [pool.submit(post, stack, pod) for _ in range(HELD)]
        eventually(lambda: series(stack, "pdproc_prefills_in_flight") == {pod: HELD})
        stack.sim_post("prefill", "/sim/faults", {"clear": True})
        assert [answer.result() for answer in answers] == [200] * HELD
    for _ in range(20):  # more, spread over both workers
        assert post(stack, pod) == 200
    eventually(lambda: series(stack, "pdproc_prefills_in_flight") == {})


def test_a_closed_breaker_leaves_the_page(stack: Stack) -> None:
    pod = str(stack.sim.prefill)
    stack.sim_post("prefill", "/sim/faults", {"prefill_status": 500})
    for _ in range(MAX_REQUESTS):
        assert post(stack, pod) in (502, 503)  # 503: that worker's breaker is open already
        if series(stack, "pdproc_prefill_breaker_open").get(pod) == 1:
            break
    assert series(stack, "pdproc_prefill_breaker_open") == {pod: 1}
    stack.sim_post("prefill", "/sim/faults", {"clear": True})
    # Each worker's breaker closes with the first request it lets through after its cooldown.
    for _ in range(MAX_REQUESTS):
        assert post(stack, pod) in (200, 503)
        if series(stack, "pdproc_prefill_breaker_open") == {}:
            break
        time.sleep(0.05)
    assert series(stack, "pdproc_prefill_breaker_open") == {}


def test_max_targets_bounds_the_page_across_workers(stack: Stack) -> None:
    """Ports that refuse connections, each its own target on its own loopback address (so
    no host's breaker of never-served ports refuses the next one first): each opens a
    breaker in the worker that tried it. The page names at most --max-targets of them, the
    rest `other`."""
    for index in range(REFUSED_PORTS):
        host = f"127.0.0.{10 + index}"
        assert post(stack, f"{host}:{refused_port(host)}") == 502
    open_breakers = series(stack, "pdproc_prefill_breaker_open")
    assert len(open_breakers) <= MAX_TARGETS + 1, open_breakers
    assert set(open_breakers.values()) == {1}
    assert open_breakers.get("other") == 1
    assert series(stack, "pdproc_prefills_in_flight") == {}
    log = stack.pdproc.log_path.read_text()
    assert "Removal of labels has not been implemented" not in log


def refused_port(host: str = "127.0.0.1") -> int:
    """A loopback port nothing listens on (just released by the kernel)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    return port


def test_both_workers_served(stack: Stack) -> None:
    """The tests above mean something only if both workers took requests."""
    served = set()
    for line in stack.pdproc.log_path.read_text().splitlines():
        if line.startswith("{"):
            entry = orjson.loads(line)
            if str(entry["msg"]).startswith("pd request prefill"):
                served.add(entry["pid"])
    assert len(served) == 2, served
