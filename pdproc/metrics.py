"""Prometheus metrics. Every request and every prefill ends in exactly one counter.

Each processor instance owns its registry, so tests can run several in one interpreter.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class Metrics:
    def exposition(self) -> bytes:
        """The /metrics page: this process's registry, or every worker's with --workers."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, directory)  # type: ignore[no-untyped-call]
        return generate_latest(registry)

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdproc_requests",
            "Requests seen by the processor, by P/D path and outcome "
            "(pd, passthrough, decode_only or an error kind).",
            ["path", "outcome"],
            registry=r,
        )
        self.prefills = Counter(
            "pdproc_prefills",
            "Prefill requests finished, by outcome (2xx, 4xx, 5xx, timeout, connect_error, error).",
            ["outcome"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "pdproc_prefill_duration_seconds",
            "Prefill request duration.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefills_in_flight = Gauge(
            "pdproc_prefills_in_flight",
            "Prefills in flight per target.",
            ["target"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.bootstrap_seconds = Histogram(
            "pdproc_bootstrap_query_duration_seconds",
            "Mooncake bootstrap /query duration.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_cache = Counter(
            "pdproc_engine_cache_events",
            "Engine-id cache lookups and invalidations (hit, miss, invalidation).",
            ["event"],
            registry=r,
        )
        self.aborts = Counter(
            "pdproc_decode_aborts",
            "Decode requests aborted by the processor because their prefill failed, by when "
            "(before_response = before the decode answered, held = while holding its headers).",
            ["when"],
            registry=r,
        )
        self.processing_seconds = Histogram(
            "pdproc_request_processing_seconds",
            "Time spent inside the processor on the request path (headers + body messages).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.hold_seconds = Histogram(
            "pdproc_response_hold_seconds",
            "Time the decode's response headers were held waiting for the prefill outcome.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.breaker_open = Gauge(
            "pdproc_prefill_breaker_open",
            "1 while the circuit breaker of a prefill target is open.",
            ["target"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.streams_active = Gauge(
            "pdproc_streams_active",
            "ext_proc streams currently open.",
            registry=r,
            multiprocess_mode="livesum",
        )
