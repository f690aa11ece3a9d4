"""One trace from Envoy through pdproc to the prefill pod.

Envoy runs with its OpenTelemetry tracer on and pdproc with `OTEL_TRACES_EXPORTER=otlp`;
both export to an OTLP collector this test runs on loopback. The client sends no trace
context: Envoy starts the trace, and hands its context to pdproc in the ext_proc call's
gRPC metadata (it injects HTTP headers only at the router). pdproc's spans must join
that trace, and the prefill request must carry it on.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from pdproc_sim.devstack import free_port, running_stack

from tests.waiting import eventually

pytestmark = pytest.mark.e2e

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append(
                            Span(
                                resource.get("service.name", ""),
                                span.name,
                                span.trace_id.hex(),
                                span.span_id.hex(),
                                span.parent_span_id.hex(),
                                {a.key: _value(a.value) for a in span.attributes},
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield servicer, port
    server.stop(grace=None)


def with_envoy_tracing(port: int) -> Any:
    """Envoy's OpenTelemetry tracer, every request sampled, spans to the collector."""

    def hook(bootstrap: dict[str, Any]) -> None:
        listener = bootstrap["static_resources"]["listeners"][0]
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        manager["tracing"] = {
            "random_sampling": {"value": 100},
            "provider": {
                "name": "envoy.tracers.opentelemetry",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                    "grpc_service": {"envoy_grpc": {"cluster_name": "otel"}, "timeout": "1s"},
                    "service_name": "gateway",
                },
            },
        }
        bootstrap["static_resources"]["clusters"].append(
            {
                "name": "otel",
                "type": "STATIC",
                "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/"
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}},
                    }
                },
                "load_assignment": {
                    "cluster_name": "otel",
                    "endpoints": [
                        {
                            "lb_endpoints": [
                                {
                                    "endpoint": {
                                        "address": {
                                            "socket_address": {
                                                "address": "127.0.0.1",
                                                "port_value": port,
                                            }
                                        }
                                    }
                                }
                            ]
                        }
                    ],
                },
            }
        )

    return hook


def _otlp_env(port: int, service: str, **more: str) -> dict[str, str]:
    """pdproc's environment: its spans to the collector on `port`, under `service`."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        **more,
        "OTEL_SERVICE_NAME": service,
    }


def _chat_with_prefill(st: Any) -> dict[str, Any]:
    """One chat request through Envoy, paired with the simulated prefill; the request the
    prefill pod received."""
    response = httpx.post(
        st.envoy.url + "/v1/chat/completions",
        json=CHAT,
        headers={"x-prefiller-host-port": str(st.sim.prefill)},
        timeout=30,
    )
    assert response.status_code == 200
    prefill: dict[str, Any] = st.sim_get("prefill", "/sim/requests")["requests"][-1]
    return prefill


def _named(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s.name == name]


def _request_span_with_gateway(servicer: Collector) -> Span | None:
    """pdproc's request span, once its prefill span and Envoy's spans have arrived too."""
    spans = servicer.snapshot()
    if not _named(spans, "pdproc.prefill"):
        return None
    if not any(s.service == "gateway" for s in spans):
        return None
    return next(iter(_named(spans, "pdproc.request")), None)


@pytest.mark.parametrize("mode", ["two-message", "single-message"])
def test_one_trace_from_envoy_through_pdproc_to_the_prefill(
    collector: tuple[Collector, int], mode: str
) -> None:
    servicer, port = collector
    env = _otlp_env(
        port, "pdproc-under-test", OTEL_RESOURCE_ATTRIBUTES="deployment.environment=e2e"
    )
    options = {"single_message": mode == "single-message"}
    with running_stack(
        ["--itl-ms", "5"],
        envoy_options=options,
        envoy_config_hook=with_envoy_tracing(port),
        pdproc_env=env,
    ) as st:
        prefill = _chat_with_prefill(st)
        ours: Span = eventually(partial(_request_span_with_gateway, servicer), timeout_s=30)
        time.sleep(0.5)  # the gateway's last spans
        spans = [s for s in servicer.snapshot() if s.trace_id == ours.trace_id]
        servicer.spans.clear()

    by_id = {s.span_id: s for s in spans}
    gateway = [s for s in spans if s.service == "gateway"]
    assert gateway, "Envoy's spans are not in pdproc's trace"
    check_request_span_under_the_gateway(ours, by_id)
    check_prefill_span_and_its_context(spans, ours, prefill, st.sim.prefill.port)
    roots = [s for s in spans if s.parent_id not in by_id]
    assert len(roots) == 1
    assert roots[0].service == "gateway"


def check_request_span_under_the_gateway(ours: Span, by_id: dict[str, Span]) -> None:
    """pdproc's request span hangs under one of Envoy's spans: a single tree, not a new root
    and not a sibling parented on a client's context."""
    assert ours.parent_id in by_id
    assert by_id[ours.parent_id].service == "gateway"
    assert ours.service == "pdproc-under-test"  # OTEL_SERVICE_NAME is honoured
    assert ours.attributes["rpc.system"] == "grpc"
    assert ours.attributes["rpc.method"] == "Process"


def check_prefill_span_and_its_context(
    spans: list[Span], ours: Span, prefill: dict[str, Any], prefill_port: int
) -> None:
    """One prefill span under the request span, and the prefill pod received its context."""
    (prefill_span,) = _named(spans, "pdproc.prefill")
    assert prefill_span.parent_id == ours.span_id
    assert prefill_span.attributes["server.address"] == "127.0.0.1"
    assert prefill_span.attributes["server.port"] == prefill_port
    traceparent = prefill["headers"]["traceparent"]
    assert traceparent.split("-")[1:3] == [ours.trace_id, prefill_span.span_id]


class ZipkinCollector(ThreadingHTTPServer):
    """Zipkin's v2 JSON span endpoint (POST /api/v2/spans), as Envoy's Zipkin tracer posts."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ZipkinHandler)
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.spans)


class _ZipkinHandler(BaseHTTPRequestHandler):
    server: ZipkinCollector

    def do_POST(self) -> None:
        if "content-length" in self.headers:
            body = self.rfile.read(int(self.headers["content-length"]))
        else:  # chunked, as Envoy's async client sends it
            body = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        with self.server.lock:
            self.server.spans.extend(json.loads(body or b"[]"))
        self.send_response(202)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def zipkin() -> Iterator[ZipkinCollector]:
    server = ZipkinCollector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def with_envoy_zipkin(port: int) -> Any:
    """Envoy's Zipkin tracer (B3 headers, as Envoy Gateway or Istio set up with Zipkin
    tracing send them), 128-bit trace ids, every request sampled."""

    def hook(bootstrap: dict[str, Any]) -> None:
        listener = bootstrap["static_resources"]["listeners"][0]
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        manager["tracing"] = {
            "random_sampling": {"value": 100},
            "provider": {
                "name": "envoy.tracers.zipkin",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
                    "collector_cluster": "zipkin",
                    "collector_endpoint": "/api/v2/spans",
                    "collector_endpoint_version": "HTTP_JSON",
                    "trace_id_128bit": True,
                },
            },
        }
        address = {"socket_address": {"address": "127.0.0.1", "port_value": port}}
        bootstrap["static_resources"]["clusters"].append(
            {
                "name": "zipkin",
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": {
                    "cluster_name": "zipkin",
                    "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
                },
            }
        )

    return hook


def _service_request_span(servicer: Collector, service: str) -> Span | None:
    """The request span of `service`, once its prefill span has arrived too."""
    spans = [s for s in servicer.snapshot() if s.service == service]
    if not _named(spans, "pdproc.prefill"):
        return None
    return next(iter(_named(spans, "pdproc.request")), None)


def _prefill_span_of(servicer: Collector, trace_id: str) -> Span:
    return next(s for s in _named(servicer.snapshot(), "pdproc.prefill") if s.trace_id == trace_id)


def _envoy_spans_with_parent(zipkin: ZipkinCollector, request: Span) -> list[dict[str, Any]] | None:
    """Envoy's Zipkin spans of the request's trace, once the one pdproc names as its parent
    is among them."""
    found = [s for s in zipkin.snapshot() if s.get("traceId") == request.trace_id]
    return found if request.parent_id in {s["id"] for s in found} else None


def test_b3_trace_from_a_zipkin_traced_envoy_joins(
    collector: tuple[Collector, int], zipkin: ZipkinCollector
) -> None:
    """OTEL_PROPAGATORS=b3multi: Envoy's Zipkin tracer hands pdproc B3 headers in the
    ext_proc call's metadata; pdproc's spans join Envoy's trace and the prefill request
    carries B3 headers on."""
    servicer, port = collector
    env = _otlp_env(port, "pdproc-b3", OTEL_PROPAGATORS="b3multi")
    with running_stack(
        ["--itl-ms", "5"],
        envoy_config_hook=with_envoy_zipkin(zipkin.server_address[1]),
        pdproc_env=env,
    ) as st:
        prefill = _chat_with_prefill(st)
        request: Span = eventually(
            partial(_service_request_span, servicer, "pdproc-b3"), timeout_s=30
        )
        prefill_span = _prefill_span_of(servicer, request.trace_id)
        # Envoy flushes Zipkin spans every 5 s (or every 5 spans), not all in one report: wait
        # for the span pdproc names as its parent (never there if pdproc started a new trace).
        gateway = eventually(partial(_envoy_spans_with_parent, zipkin, request), timeout_s=30)

    # One trace: pdproc's request span hangs under one of Envoy's Zipkin spans.
    assert request.parent_id in {s["id"] for s in gateway}
    assert prefill_span.parent_id == request.span_id
    # The prefill pod got B3 headers (b3multi), with pdproc's prefill span as the parent.
    headers = prefill["headers"]
    assert headers["x-b3-traceid"] == request.trace_id
    assert headers["x-b3-spanid"] == prefill_span.span_id
    assert "traceparent" not in headers
