"""Prometheus metrics. Every request and every prefill ends in exactly one counter.

Each processor instance owns its registry, so tests can run several in one interpreter.
Per-target series (prefills in flight, open breakers) exist only while there is something
to report and at most `max_targets` of them: targets may come from a request header, so a
client choosing ports must not grow the page.

These are one process's metrics. A worker of several (--workers) keeps its own in
prometheus_client's per-process files, and any worker serves the page of all of them
(pdproc.multiprocess.worker_metrics); each gauge's `multiprocess_mode` says how that page
combines the workers' values.
"""

from __future__ import annotations

import contextlib
from typing import Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from pdproc import __version__
from pdproc.outcomes import PREFILL_OUTCOMES, REQUEST_OUTCOMES, PrefillResult
from pdproc.targets import HostPort
from pdproc.tls_reload import TlsMaterial

# `_created` series double the number of counter series and nobody graphs them.
disable_created_metrics()  # type: ignore[no-untyped-call]

OTHER_TARGETS = "other"
# The per-target families, and the build info (the same in every process).
IN_FLIGHT = "pdproc_prefills_in_flight"
BREAKER_OPEN = "pdproc_prefill_breaker_open"
BUILD, _BUILD_HELP = "pdproc_build", "pdproc version."

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


M = TypeVar("M", Counter, Gauge)


def _series(cache: dict[Any, M], family: M, label: Any) -> M:
    """`family`'s series of `label`, looked up once while it exists (labels() takes a lock
    and checks every value on each call: this is for series written on every request)."""
    series = cache.get(label)
    if series is None:
        series = cache[label] = family.labels(label)
    return series


class Metrics:
    # Whether a finished per-target series is removed (a process's own registry can).
    _removes_series = True

    def exposition(self) -> bytes:
        """The /metrics page."""
        return generate_latest(self.registry)

    def __init__(self, registry: CollectorRegistry | None = None, max_targets: int = 1024) -> None:
        self.registry = registry or CollectorRegistry()
        self._max_targets = max_targets
        self._flight_labels: dict[HostPort, str] = {}
        self._flight_series: dict[str, Gauge] = {}
        self._prefill_series: dict[PrefillResult, Counter] = {}
        r = self.registry
        # CPU and memory of this process (with --workers the page adds up the workers').
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        Info(BUILD, _BUILD_HELP, registry=r).info({"version": __version__})
        self.requests = Counter(
            "pdproc_requests",
            "Requests seen by the processor, by P/D path, outcome "
            f"({', '.join(REQUEST_OUTCOMES)}) and KV connector.",
            ["path", "outcome", "connector"],
            registry=r,
        )
        self.prefills = Counter(
            "pdproc_prefills",
            f"Prefill requests finished, by outcome ({', '.join(PREFILL_OUTCOMES)}).",
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
            IN_FLIGHT,
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
        self.probes = Counter(
            "pdproc_prefill_probes",
            "Background probes of pool members whose breaker is open, by what they found "
            "(up: the breaker closed; down: it stays open).",
            ["result"],
            registry=r,
        )
        self.reroutes = Counter(
            "pdproc_bootstrap_reroutes",
            "P/D requests moved to another prefill pool member because the chosen one's "
            "bootstrap query failed before anything was sent to it.",
            registry=r,
        )
        self.processing_seconds = Histogram(
            "pdproc_request_processing_seconds",
            "Time spent inside the processor on the request path (headers + body messages).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.streamed_bodies = Counter(
            "pdproc_streamed_request_bodies",
            "P/D request bodies streamed on to the decode as they arrived "
            "(--stream-body-bytes) instead of buffered and sent back whole.",
            registry=r,
        )
        self.hold_seconds = Histogram(
            "pdproc_response_hold_seconds",
            "Time the decode's response headers were held waiting for the prefill outcome.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pool_choices = Counter(
            "pdproc_pool_choices",
            "Pool mode's prefix policy, per request: prefix (a member holding part of the "
            "prompt won), home (none did: the prompt's home), balance or kept (the "
            "header-time pick stayed).",
            ["reason"],
            registry=r,
        )
        self.decode_choices = Counter(
            "pdproc_decode_choices",
            "--decode-choice prefix, per request: cached (the decode holds most of the "
            "prompt and serves it alone), prefix (it holds part of it), home or balance.",
            ["reason"],
            registry=r,
        )
        self.prefix_index_blocks = Gauge(
            "pdproc_prefix_index_blocks",
            "Prompt blocks the prefix policy remembers, all pool members together (about "
            "120 bytes each).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.breaker_open = Gauge(
            BREAKER_OPEN,
            "1 while the circuit breaker of a prefill target is open.",
            ["target"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.unproven_open = Gauge(
            "pdproc_unproven_port_breakers_open",
            "Hosts whose header-named ports that never answered 2xx are failing: such ports "
            "of them are refused without a connection (pool members and proven ports are not).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.unproven_refusals = Counter(
            "pdproc_unproven_port_refusals",
            "P/D requests whose header-named target never answered 2xx, refused (or served "
            "decode-only) without a connection because its host's unproven-ports breaker is "
            "open.",
            registry=r,
        )
        self.bodies_bytes = Gauge(
            "pdproc_request_body_bytes_in_flight",
            "Request-body bytes held by streams being processed (bounded by --max-inflight-bytes).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.dns_lookups = Counter(
            "pdproc_dns_lookups",
            "--prefill-dns and --decode-dns lookups, by outcome (ok, empty, error, timeout); "
            "all but ok keep the last good pool.",
            ["outcome"],
            registry=r,
        )
        self.tls_expiry = Gauge(
            "pdproc_tls_certificate_expiry_timestamp_seconds",
            "Not-after time (Unix seconds) of the certificate served on the ext_proc port "
            "(certificate=served) and the earliest of the --tls-client-ca bundle "
            "(certificate=client_ca).",
            ["certificate"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.tls_reloads = Counter(
            "pdproc_tls_reloads",
            "Changed --tls-* files, by outcome (ok: served from the next handshake; error: "
            "rejected, the previous ones kept).",
            ["outcome"],
            registry=r,
        )
        self.streams_active = Gauge(
            "pdproc_streams_active",
            "ext_proc streams currently open.",
            registry=r,
            multiprocess_mode="livesum",
        )

    def tls_loaded(self, outcome: str, served: TlsMaterial) -> None:
        """A TLS files check: `start`, `ok` (reloaded) or `error` (rejected); `served` is
        what the next handshakes get."""
        if outcome != "start":
            self.tls_reloads.labels(outcome).inc()
        self.tls_expiry.labels("served").set(served.not_after)
        if served.client_ca_not_after is not None:
            self.tls_expiry.labels("client_ca").set(served.client_ca_not_after)

    def _label(self, target: HostPort, in_use: int) -> str:
        """The label of a target's series: its own while under the bound, else `other`."""
        return str(target) if in_use < self._max_targets else OTHER_TARGETS

    def prefill_started(self, target: HostPort) -> None:
        label = self._flight_labels.get(target)
        if label is None:
            # A series of its own while under the bound; past it, targets share one.
            label = self._flight_labels[target] = self._label(target, len(self._flight_labels))
        self._in_flight(label).inc()

    def prefill_finished(self, target: HostPort, still_in_flight: int) -> None:
        label = self._flight_labels.get(target, OTHER_TARGETS)
        if still_in_flight == 0:
            self._flight_labels.pop(target, None)
            if label != OTHER_TARGETS and self._removes_series:
                # Nothing in flight: drop the series, so pods that are gone leave no trace.
                self._flight_series.pop(label, None)
                self.prefills_in_flight.remove(label)
                return
        self._in_flight(label).dec()

    def _in_flight(self, label: str) -> Gauge:
        return _series(self._flight_series, self.prefills_in_flight, label)

    def prefill_ended(self, outcome: PrefillResult) -> None:
        """Count one finished prefill."""
        _series(self._prefill_series, self.prefills, outcome).inc()

    def unproven_changed(self, host: str, is_open: bool) -> None:
        if is_open:
            self.unproven_open.inc()
        else:
            self.unproven_open.dec()

    def breaker_changed(self, target: HostPort, is_open: bool) -> None:
        """Breaker states are bounded by --max-targets already; a closed one has no series."""
        if is_open:
            self.breaker_open.labels(str(target)).set(1)
        else:
            with contextlib.suppress(KeyError):
                self.breaker_open.remove(str(target))
