"""OTEL_PROPAGATORS and the start-up line that says where spans go."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider

from pdproc.telemetry import Tracing, describe_tracing, propagator_from_env

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
ENVOY_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = "00-11111111111111111111111111111111-2222222222222222-01"


def parent_of(
    tracing: Tracing, metadata: dict[str, str], headers: dict[str, str]
) -> tuple[str, str]:
    span = tracing.request_span(headers, "/v1/completions", "POST", lambda: metadata)
    assert span is not None
    parent = span.parent  # type: ignore[attr-defined]
    span.end()
    if parent is None:
        return "", ""
    return f"{parent.trace_id:032x}", f"{parent.span_id:016x}"


@pytest.mark.parametrize(
    ("propagators", "metadata"),
    [
        ("tracecontext,baggage", {"traceparent": f"00-{TRACE_ID}-{ENVOY_SPAN}-01"}),
        ("b3multi", {"x-b3-traceid": TRACE_ID, "x-b3-spanid": ENVOY_SPAN, "x-b3-sampled": "1"}),
        ("b3", {"b3": f"{TRACE_ID}-{ENVOY_SPAN}-1"}),
    ],
)
def test_envoy_span_in_the_call_metadata_is_the_parent(
    propagators: str, metadata: dict[str, str]
) -> None:
    tracing = Tracing(TracerProvider(), propagator_from_env({"OTEL_PROPAGATORS": propagators}))
    # The client's own W3C header loses to Envoy's context in the gRPC metadata.
    headers = {"traceparent": CLIENT_TRACEPARENT}
    assert parent_of(tracing, metadata, headers) == (TRACE_ID, ENVOY_SPAN)


def test_b3_written_on_the_prefill_request() -> None:
    tracing = Tracing(TracerProvider(), propagator_from_env({"OTEL_PROPAGATORS": "b3multi"}))
    span = tracing.request_span({}, "/v1/completions", "POST", lambda: {})
    outgoing: dict[str, str] = {}
    tracing.inject(span, outgoing)
    assert span is not None
    assert outgoing["x-b3-traceid"] == f"{span.get_span_context().trace_id:032x}"
    assert "traceparent" not in outgoing


def test_no_metadata_falls_back_to_the_client_headers() -> None:
    tracing = Tracing(TracerProvider(), propagator_from_env({}))
    assert parent_of(tracing, {}, {"traceparent": CLIENT_TRACEPARENT}) == (
        "1" * 32,
        "2" * 16,
    )


def test_unknown_propagator_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown propagator 'jaeger' \(choose from "):
        propagator_from_env({"OTEL_PROPAGATORS": "tracecontext, jaeger"})
    assert not propagator_from_env({"OTEL_PROPAGATORS": "none"}).fields


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "tracing off"),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "spans to otlp grpc to http://localhost:4317"),
        (
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
            },
            "otlp http/protobuf to http://collector:4318/v1/traces",
        ),
        (
            {
                "OTEL_TRACES_EXPORTER": "otlp,console",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://tempo:4317",
                "OTEL_PROPAGATORS": "b3multi",
            },
            "spans to otlp grpc to http://tempo:4317, console; propagators b3multi",
        ),
    ],
)
def test_describe_tracing(env: dict[str, str], expected: str) -> None:
    assert expected in describe_tracing(env)
