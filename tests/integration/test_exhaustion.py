"""Pdproc's own resource exhaustion is never held against a pod.

A prefill connect that failed because pdproc was out of file descriptors ("Too many open
files") used to count as the pod's `connect_error` and open healthy pods' breakers. Here a
real `pdproc serve` runs under an open-file limit of 320 (soft and hard) while more P/D
requests than that wait on a prefill pod that holds every prefill open: the prefill
connects beyond the limit really fail with EMFILE. Those requests get 503 `overloaded`,
their prefills count `exhausted`, the pod's breaker (opening at the first failure here)
stays closed, and once the held prefills end the pod serves P/D again.
"""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from pdproc_sim import PrefillConfig, RunningPrefill, start_prefill
from pdproc_sim.devstack import free_port
from prometheus_client.parser import text_string_to_metric_families

from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from tests.envoy_side import CHAT, body_msg, channel, headers_msg, recv, response_headers_msg
from tests.waiting import eventually_async

LIMIT = 320
REQUESTS = 360  # more prefills than descriptors


@pytest.fixture
async def prefill() -> AsyncIterator[RunningPrefill]:
    running = await start_prefill(PrefillConfig(dp_ranks=1))
    yield running
    await running.close()


def cap_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


async def scrape(metrics_port: int) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)).text


class Page:
    """A scraped /metrics page (of a pdproc in another process)."""

    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))

    def sample(self, name: str, **labels: str) -> float:
        total = 0.0
        for family in self.families:
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    total += sample.value
        return total


async def test_pdproc_out_of_descriptors_is_not_the_pods_fault(
    prefill: RunningPrefill, tmp_path: Path
) -> None:
    grpc_port, metrics_port = free_port(), free_port()
    argv = _serve_argv(prefill, grpc_port, metrics_port)
    log = (tmp_path / "pdproc.log").open("w")
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=cap_descriptors
    )
    to_pdproc = channel(grpc_port)
    calls: list[Any] = []
    try:
        await eventually_async(lambda: _ready(metrics_port), timeout_s=30)
        stub = pb_grpc.ExternalProcessorStub(to_pdproc)
        target = {"x-prefiller-host-port": prefill.address}
        # One whole request first: the engine map is cached.
        call = stub.Process()
        await call.write(headers_msg(extra=target))
        await recv(call)
        await call.write(body_msg(CHAT))
        await recv(call)
        await call.write(response_headers_msg("200"))
        await recv(call)
        call.cancel()
        await _faults(prefill, prefill_hang=True)
        for _ in range(REQUESTS):
            call = stub.Process()
            calls.append(call)
            await call.write(headers_msg(extra=target))
            await recv(call, timeout_s=30)
            await call.write(body_msg(CHAT))
            await recv(call, timeout_s=30)
        # The prefills beyond the limit failed at once: their streams were aborted. Every
        # other prefill is held by the pod, so once each request is one or the other no
        # abort is still to come (no fixed wait for answers that never come).
        reads = [asyncio.ensure_future(_abort_of(c)) for c in calls]
        await eventually_async(lambda: _all_settled(reads, prefill), timeout_s=30)
        refused = [status for status in map(_status_of, reads) if status is not None]
        # The held requests go away while their prefills still hang, which gives pdproc its
        # descriptors back (a prefill that ended instead would keep its pooled connection).
        for call in calls:
            call.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        assert refused, "no prefill ran out of descriptors"
        assert set(refused) == {503}
        await _faults(prefill, prefill_hang=False)
        page = Page(await _scrape_when_possible(metrics_port))
        assert page.sample("pdproc_prefills_total", outcome="exhausted") == len(refused)
        assert page.sample("pdproc_prefills_total", outcome="connect_error") == 0
        assert page.sample("pdproc_requests_total", outcome="overloaded") == len(refused)
        assert page.sample("pdproc_prefill_breaker_open") == 0
        await _assert_serves_pd_again(stub, target)
    finally:
        await _faults(prefill, prefill_hang=False)
        await to_pdproc.close()
        process.terminate()
        async with asyncio.timeout(30):
            await process.wait()
        log.close()
    _assert_logged(tmp_path / "pdproc.log", "Too many open files")


def _serve_argv(prefill: RunningPrefill, grpc_port: int, metrics_port: int) -> list[str]:
    """`pdproc serve` with a breaker that opens at the first failure against the pod."""
    assert prefill.bootstrap_port is not None
    script = Path(sys.executable).with_name("pdproc")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "pdproc.cli"]
    argv = [*head, "serve", "--listen", f"127.0.0.1:{grpc_port}", "--workers", "1"]
    argv += ["--metrics-listen", f"127.0.0.1:{metrics_port}", "--shutdown-delay", "0"]
    argv += ["--prefill-allow", "127.0.0.1/32", "--breaker-failures", "1"]
    argv += ["--mooncake-bootstrap-port", str(prefill.bootstrap_port), "--drain-timeout", "5"]
    return argv


async def _assert_serves_pd_again(stub: Any, target: dict[str, str]) -> None:
    """A P/D request to the pod gets its body rewritten: the pod is in use again."""
    call = stub.Process()
    await call.write(headers_msg(extra=target))
    await recv(call)
    await call.write(body_msg(CHAT))
    assert (await recv(call)).request_body.response.HasField("body_mutation")
    call.cancel()


def _assert_logged(log: Path, text: str) -> None:
    assert text in log.read_text()


async def _ready(metrics_port: int) -> bool:
    try:
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://127.0.0.1:{metrics_port}/readyz", timeout=2)
            return response.status_code == 200
    except httpx.TransportError:
        return False


async def _scrape_when_possible(metrics_port: int) -> str:
    """The metrics page, once pdproc has descriptors again to accept the scrape."""
    page: list[str] = []

    async def got() -> bool:
        try:
            page.append(await scrape(metrics_port))
        except httpx.TransportError:
            return False
        return True

    await eventually_async(got, timeout_s=30)
    return page[-1]


async def _abort_of(call: Any) -> int | None:
    """The status of an unsolicited immediate response on `call`, None for anything else."""
    answer = await call.read()
    if answer is grpc.aio.EOF or not answer.HasField("immediate_response"):
        return None
    return int(answer.immediate_response.status.code)


def _all_settled(reads: list[asyncio.Future[int | None]], prefill: RunningPrefill) -> bool:
    """Every request has either had its answer or has its prefill held by the pod."""
    return sum(read.done() for read in reads) + prefill.state.in_flight >= len(reads)


def _status_of(read: asyncio.Future[int | None]) -> int | None:
    """The abort `read` saw, None if nothing came (yet: its prefill is held)."""
    return read.result() if read.done() else None


async def _faults(prefill: RunningPrefill, **faults: Any) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(prefill.url + "/sim/faults", json=faults)
        response.raise_for_status()
