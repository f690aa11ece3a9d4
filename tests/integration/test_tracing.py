"""Spans through a real gRPC stream, collected by the SDK's in-memory exporter."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from pdproc_sim import PrefillConfig, RunningPrefill, start_prefill

from pdproc.config import Settings
from pdproc.server import Server
from pdproc.targets import AllowList, HostPort
from pdproc.telemetry import provider_from_env
from tests.envoy_side import (
    CHAT,
    Pdproc,
    body_msg,
    headers_msg,
    recv,
    response_headers_msg,
)
from tests.waiting import eventually_async

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class Traced(Pdproc):
    """The shared in-process pdproc, its spans exported in memory."""

    def __init__(self, server: Server, exporter: InMemorySpanExporter) -> None:
        super().__init__(server)
        self.exporter = exporter

    async def spans(self, count: int) -> dict[str, ReadableSpan]:
        await eventually_async(lambda: len(self.exporter.get_finished_spans()) >= count, 10)
        return {span.name: span for span in self.exporter.get_finished_spans()}


@pytest.fixture
async def prefill() -> AsyncIterator[RunningPrefill]:
    running = await start_prefill(PrefillConfig(dp_ranks=2))
    yield running
    await running.close()


@pytest.fixture
async def traced(prefill: RunningPrefill) -> AsyncIterator[Traced]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert prefill.bootstrap_port is not None
    settings = Settings(
        listen=HostPort("127.0.0.1", 0),
        mooncake_bootstrap_port=prefill.bootstrap_port,
        prefill_allow=AllowList.parse(["127.0.0.1/32"]),
    )
    server = Server(settings, tracer_provider=provider)
    await server.start()
    traced = Traced(server, exporter)
    yield traced
    await traced.channel.close()
    await server.stop(drain_timeout_s=5)


async def pd_exchange(t: Traced, prefill: RunningPrefill) -> Any:
    call = t.stub.Process()
    extra = {"x-prefiller-host-port": prefill.address, "traceparent": TRACEPARENT}
    await call.write(headers_msg(extra=extra))
    await recv(call)
    await call.write(body_msg(CHAT))
    await recv(call)
    return call


def assert_parented(request: ReadableSpan, *children: ReadableSpan) -> None:
    """Parented on the trace context Envoy forwarded; children of the request span."""
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert request.parent is not None
    assert format(request.parent.span_id, "016x") == "00f067aa0ba902b7"
    for child in children:
        assert child.context.trace_id == request.context.trace_id
        assert child.parent is not None
        assert child.parent.span_id == request.context.span_id


def assert_request_attributes(request: ReadableSpan) -> None:
    attrs = request.attributes or {}
    assert attrs["pdproc.outcome"] == "pd"
    assert attrs["url.path"] == "/v1/chat/completions"
    assert attrs["pdproc.transfer_id"].startswith("xfer-")  # type: ignore[union-attr]


def assert_prefill_attributes(
    prefill_span: ReadableSpan, request: ReadableSpan, prefill: RunningPrefill
) -> None:
    attrs = request.attributes or {}
    p_attrs = prefill_span.attributes or {}
    assert p_attrs["http.response.status_code"] == 200
    assert p_attrs["pdproc.prefill.outcome"] == "2xx"
    assert p_attrs["pdproc.prefill.target"] == prefill.address
    assert p_attrs["pdproc.transfer_id"] == attrs["pdproc.transfer_id"]
    assert p_attrs["pdproc.engine_id"] == prefill.engine_ids[int(p_attrs["pdproc.dp_rank"])]  # type: ignore[arg-type]


async def test_span_tree_of_a_pd_request(traced: Traced, prefill: RunningPrefill) -> None:
    call = await pd_exchange(traced, prefill)
    await call.write(response_headers_msg("200"))
    while (await recv(call)).WhichOneof("response") != "response_headers":
        pass
    await call.done_writing()
    spans = await traced.spans(3)
    request, bootstrap, prefill_span = (
        spans["pdproc.request"],
        spans["pdproc.bootstrap"],
        spans["pdproc.prefill"],
    )
    assert_parented(request, bootstrap, prefill_span)
    assert_request_attributes(request)
    assert_prefill_attributes(prefill_span, request, prefill)
    assert (bootstrap.attributes or {})["pdproc.bootstrap.engines"] == 2

    # The prefill request carried the prefill span's context, not the client's.
    async with httpx.AsyncClient() as client:
        record = (await client.get(prefill.url + "/sim/requests")).json()["requests"][-1]
    expected = f"00-{TRACE_ID}-{prefill_span.context.span_id:016x}-01"
    assert record["headers"]["traceparent"] == expected


async def test_failed_prefill_marks_spans_as_errors(
    traced: Traced, prefill: RunningPrefill
) -> None:
    async with httpx.AsyncClient() as client:
        await client.post(prefill.url + "/sim/faults", json={"prefill_status": 503})
    call = await pd_exchange(traced, prefill)
    abort = await recv(call)
    assert abort.immediate_response.status.code == 502
    await call.done_writing()
    spans = await traced.spans(3)
    request, prefill_span = spans["pdproc.request"], spans["pdproc.prefill"]
    assert prefill_span.status.status_code is StatusCode.ERROR
    assert (prefill_span.attributes or {})["pdproc.prefill.outcome"] == "5xx"
    assert request.status.status_code is StatusCode.ERROR
    assert (request.attributes or {})["pdproc.outcome"] == "prefill_failed"


def test_exporter_choice_follows_otel_env() -> None:
    assert provider_from_env({}) is None
    assert provider_from_env({"OTEL_TRACES_EXPORTER": "none"}) is None
    assert provider_from_env({"OTEL_TRACES_EXPORTER": "console"}) is not None
    otlp = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert provider_from_env(otlp) is not None
    with pytest.raises(ValueError, match="unsupported exporter"):
        provider_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
