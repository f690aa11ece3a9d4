"""Tracing: one span per request, children for the bootstrap query and the prefill.

Configured by the standard OpenTelemetry environment variables: `OTEL_TRACES_EXPORTER`
(`otlp`, `console` or `none`, the default), `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`
(`grpc` default, or `http/protobuf`), `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`,
`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`. With no
exporter nothing is recorded and the hot path pays one attribute check.

Spans are parented on Envoy's own span: with tracing on, Envoy puts its trace context in
the gRPC metadata of the ext_proc call (it injects the HTTP headers only at the router), in
the format of its tracer: W3C `traceparent` for OpenTelemetry, B3 for Zipkin. Without it, the
client's headers carry the parent. The prefill span's context is propagated into the
prefill request. `OTEL_PROPAGATORS` chooses the formats read and written (`tracecontext`,
`baggage`, `b3` single-header, `b3multi`, or `none`; default `tracecontext,baggage`): set it to
what the gateway's tracer writes, e.g. `b3multi` behind a Zipkin-traced Envoy Gateway or Istio.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping

# Not opentelemetry.propagate: it reads OTEL_PROPAGATORS on import and raises a traceback
# for a name it does not know; pdproc builds its propagator itself (propagator_from_env).
from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.b3 import B3MultiFormat, B3SingleFormat
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdproc import __version__

# Attribute names. Where llm-d's sidecar has the same fact its name is given in README.
ATTR_PATH = "url.path"
ATTR_METHOD = "http.request.method"
ATTR_REQUEST_ID = "pdproc.request_id"
ATTR_OUTCOME = "pdproc.outcome"
ATTR_TARGET = "pdproc.prefill.target"
ATTR_CONNECTOR = "pdproc.kv_connector"
ATTR_DECODE = "pdproc.decode.target"  # the decode pdproc named (--decode-choice prefix)
ATTR_DECODE_MATCHED = "pdproc.decode.matched_blocks"  # its prompt blocks it was taken to hold
ATTR_STREAMED = "pdproc.body_streamed"
ATTR_TRANSFER_ID = "pdproc.transfer_id"
ATTR_RANK = "pdproc.dp_rank"
ATTR_ENGINE_ID = "pdproc.engine_id"
ATTR_STATUS = "http.response.status_code"
ATTR_PREFILL_OUTCOME = "pdproc.prefill.outcome"
ATTR_DURATION_MS = "pdproc.duration_ms"
ATTR_CACHE = "pdproc.bootstrap.cache"
ATTR_ENGINES = "pdproc.bootstrap.engines"
ATTR_SERVER_ADDRESS = "server.address"
ATTR_SERVER_PORT = "server.port"
# The request span is the server span of the ext_proc gRPC call.
_RPC_ATTRIBUTES = {
    "rpc.system": "grpc",
    "rpc.service": "envoy.service.ext_proc.v3.ExternalProcessor",
    "rpc.method": "Process",
}


# OTEL_PROPAGATORS names (the OpenTelemetry specification's) and their propagators.
PROPAGATORS: dict[str, Callable[[], TextMapPropagator]] = {
    "tracecontext": TraceContextTextMapPropagator,
    "baggage": W3CBaggagePropagator,
    "b3": B3SingleFormat,
    "b3multi": B3MultiFormat,
}
_DEFAULT_PROPAGATORS = "tracecontext,baggage"


def propagator_from_env(env: Mapping[str, str] | None = None) -> TextMapPropagator:
    """The propagator OTEL_PROPAGATORS names (comma-separated; `none`: none at all)."""
    env = os.environ if env is None else env
    value = env.get("OTEL_PROPAGATORS") or _DEFAULT_PROPAGATORS
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROPAGATORS and n != "none"]
    if unknown:
        choices = ", ".join([*PROPAGATORS, "none"])
        raise ValueError(
            f"OTEL_PROPAGATORS: unknown propagator {unknown[0]!r} (choose from {choices})"
        )
    if "none" in names:
        return CompositePropagator([])
    return CompositePropagator([PROPAGATORS[n]() for n in dict.fromkeys(names)])


def _trace_fields(propagator: TextMapPropagator) -> frozenset[str]:
    """The carrier keys that hold a parent span (baggage alone is no parent)."""
    return frozenset(propagator.fields) - {"baggage"}


class Tracing:
    """Spans for the processor, or nothing at all when tracing is off."""

    def __init__(
        self, provider: trace.TracerProvider | None, propagator: TextMapPropagator | None = None
    ) -> None:
        self.enabled = provider is not None
        self._tracer = (provider or trace.NoOpTracerProvider()).get_tracer("pdproc", __version__)
        if propagator is None:
            propagator = propagator_from_env() if self.enabled else CompositePropagator([])
        self._propagator = propagator
        self._parent_fields = _trace_fields(propagator)

    def request_span(
        self,
        headers: Mapping[str, str],
        path: str,
        method: str,
        call_metadata: Callable[[], Mapping[str, str]] | None = None,
    ) -> Span | None:
        if not self.enabled:
            return None  # before the call's metadata is even read: tracing off costs nothing
        metadata = call_metadata() if call_metadata is not None else {}
        # Envoy's span (in the call's metadata) if it sent one, else the client's headers.
        carrier = metadata if not self._parent_fields.isdisjoint(metadata) else headers
        parent = self._propagator.extract(carrier)
        span = self._tracer.start_span(
            "pdproc.request", context=parent, kind=SpanKind.SERVER, attributes=_RPC_ATTRIBUTES
        )
        span.set_attribute(ATTR_PATH, path)
        span.set_attribute(ATTR_METHOD, method)
        span.set_attribute(ATTR_REQUEST_ID, headers.get("x-request-id", ""))
        return span

    def child_span(self, parent: Span | None, name: str, kind: SpanKind) -> Span | None:
        if parent is None:
            return None
        return self._tracer.start_span(name, context=trace.set_span_in_context(parent), kind=kind)

    def inject(self, span: Span | None, carrier: MutableMapping[str, str]) -> None:
        """Put the span's trace context into outgoing headers (replacing the client's)."""
        if span is not None:
            self._propagator.inject(carrier, context=trace.set_span_in_context(span))


def fail(span: Span | None, message: str) -> None:
    if span is not None:
        span.set_status(Status(StatusCode.ERROR, message))


def trace_fields(span: Span | None) -> dict[str, str]:
    """`trace_id` and `span_id` for a log line, so logs and traces join up."""
    if span is None:
        return {}
    context = span.get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}


def provider_from_env(env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """A tracer provider as the OTEL_* variables ask for, or None when tracing is off."""
    env = os.environ if env is None else env
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip()]
    exporters = [_exporter(name, env) for name in names if name != "none"]
    if not exporters:
        return None
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over pdproc's own defaults.
    defaults = {"service.name": "pdproc", "service.version": __version__}
    resource = Resource.create({**defaults, **OTELResourceDetector().detect().attributes})
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def describe_tracing(env: Mapping[str, str] | None = None) -> str:
    """Where spans go, for the start-up log line (an operator's first question when no trace
    shows up): the exporters, the OTLP destination and protocol, the propagators."""
    env = os.environ if env is None else env
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip()]
    names = [n for n in names if n != "none"]
    if not names:
        return "tracing off (OTEL_TRACES_EXPORTER unset or none)"
    parts = []
    for name in names:
        if name == "otlp":
            protocol = _otlp_protocol(env)
            parts.append(f"otlp {protocol} to {_otlp_endpoint(env, protocol)}")
        else:
            parts.append(name)
    propagators = env.get("OTEL_PROPAGATORS") or _DEFAULT_PROPAGATORS
    return f"tracing: spans to {', '.join(parts)}; propagators {propagators}"


def _otlp_protocol(env: Mapping[str, str]) -> str:
    return env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )


def _otlp_endpoint(env: Mapping[str, str], protocol: str) -> str:
    """The URL the OTLP exporter uses, by the specification's rules: the signal's own
    variable as it is; the generic one with /v1/traces appended for HTTP."""
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if protocol == "grpc":
        return base or "http://localhost:4317"
    return (base or "http://localhost:4318").rstrip("/") + "/v1/traces"


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    try:
        return _load_exporter(name, env)
    except ImportError as exc:
        raise ValueError(f"the {name} trace exporter cannot be loaded: {exc}") from None


def _load_exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r}")
    protocol = _otlp_protocol(env)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: unsupported protocol {protocol!r}")
