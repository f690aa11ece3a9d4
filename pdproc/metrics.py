"""Prometheus metrics. Every request and every prefill ends in exactly one counter.

Each processor instance owns its registry, so tests can run several in one interpreter.
Per-target series (prefills in flight, open breakers) exist only while there is something
to report and at most `max_targets` of them: targets may come from a request header, so a
client choosing ports must not grow the page.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

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
    multiprocess,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pdproc import __version__
from pdproc.errors import ErrorKind
from pdproc.targets import HostPort

# `_created` series double the number of counter series and nobody graphs them.
disable_created_metrics()  # type: ignore[no-untyped-call]

OTHER_TARGETS = "other"

# Every outcome a request is counted as (pdproc_requests_total's `outcome`), exactly one per
# request. tests/unit/test_outcomes.py checks the code records no other.
REQUEST_OUTCOMES: tuple[str, ...] = (
    "pd",  # prefill and decode both answered
    "passthrough",  # not disaggregated: not a P/D request, no target, or draining
    "decode_only",  # a fallback: the decode served it alone (prefill unusable)
    "short_prompt",  # below --pd-min-prompt: the decode served it alone
    "unfinished_body",  # a streamed body answered before it ended
    "abandoned",  # the client left before the decode's answer reached it
    "cancelled",  # the same, and pdproc cancelled its running prefill
    "prefill_answer_refused",  # the prefill's answer was unfit for the decode: served alone
    *(kind.value for kind in ErrorKind),  # answered by pdproc itself
)
# Every outcome of a prefill (pdproc_prefills_total's `outcome`).
PREFILL_OUTCOMES: tuple[str, ...] = (
    "2xx",
    "3xx",
    "4xx",
    "5xx",
    "timeout",
    "connect_error",
    "error",
    "cancelled",  # the client left: pdproc cancelled it (never held against the pod)
    "exhausted",  # pdproc out of descriptors or memory (never held against the pod)
    "internal",  # a bug in pdproc (never held against the pod)
)
_BUILD, _BUILD_HELP = "pdproc_build", "pdproc version."

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
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_WorkersPage(directory, self.registry))
        return generate_latest(registry)

    def __init__(self, registry: CollectorRegistry | None = None, max_targets: int = 1024) -> None:
        self.registry = registry or CollectorRegistry()
        self._max_targets = max_targets
        self._flight_labels: dict[HostPort, str] = {}
        r = self.registry
        # CPU and memory of this process (with --workers the shared page adds up the
        # workers': _WorkersPage).
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        Info(_BUILD, _BUILD_HELP, registry=r).info({"version": __version__})
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
        self.breaker_open = Gauge(
            "pdproc_prefill_breaker_open",
            "1 while the circuit breaker of a prefill target is open.",
            ["target"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.bodies_bytes = Gauge(
            "pdproc_request_body_bytes_in_flight",
            "Request-body bytes held by streams being processed (bounded by --max-inflight-bytes).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.streams_active = Gauge(
            "pdproc_streams_active",
            "ext_proc streams currently open.",
            registry=r,
            multiprocess_mode="livesum",
        )

    def prefill_started(self, target: HostPort) -> None:
        label = self._flight_labels.get(target)
        if label is None:
            # A series of its own while under the bound; past it, targets share one.
            bounded = len(self._flight_labels) < self._max_targets
            label = self._flight_labels[target] = str(target) if bounded else OTHER_TARGETS
        self.prefills_in_flight.labels(label).inc()

    def prefill_finished(self, target: HostPort, still_in_flight: int) -> None:
        label = self._flight_labels.get(target, OTHER_TARGETS)
        if still_in_flight == 0:
            self._flight_labels.pop(target, None)
            if label != OTHER_TARGETS:
                # Nothing in flight: drop the series, so pods that are gone leave no trace.
                self.prefills_in_flight.remove(label)
                return
        self.prefills_in_flight.labels(label).dec()

    def breaker_changed(self, target: HostPort, is_open: bool) -> None:
        """Breaker states are bounded by --max-targets already; a closed one has no series."""
        if is_open:
            self.breaker_open.labels(str(target)).set(1)
        else:
            with contextlib.suppress(KeyError):
                self.breaker_open.remove(str(target))


class _WorkersPage(Collector):
    """The page of several worker processes (--workers): prometheus_client's multiprocess
    view of their metric files, plus what that view leaves out, so the page has what one
    process's page has: every declared family (also those with no sample yet), the build
    info, the Python platform, and the process metrics of the live workers added up (CPU,
    memory and descriptors summed; the earliest start time)."""

    def __init__(self, directory: str, own: CollectorRegistry) -> None:
        self._directory = directory
        self._own = own

    def collect(self) -> Iterator[Metric]:
        seen: set[str] = set()
        multi = multiprocess.MultiProcessCollector(None, self._directory)  # type: ignore[no-untyped-call]
        for family in multi.collect():  # type: ignore[no-untyped-call]
            seen.add(family.name)
            yield family
        for family in self._own.collect():
            if family.name.startswith(("pdproc_", "python_")) and family.name not in seen:
                if family.name in (_BUILD, "python_info"):
                    yield family  # the same in every worker
                else:
                    yield Metric(family.name, family.documentation, family.type)
        yield from _summed_process_metrics(_live_pids(self._directory))


def _live_pids(directory: str) -> list[int]:
    """Workers that wrote metric files and are still running."""
    pids = set()
    for name in os.listdir(directory):
        stem, _, suffix = name.rpartition(".")
        pid = stem.rpartition("_")[2]
        if suffix == "db" and pid.isdigit() and os.path.exists(f"/proc/{pid}"):
            pids.add(int(pid))
    return sorted(pids)


_EARLIEST = {"process_start_time_seconds", "process_max_fds"}


def _constant(pid: int) -> Callable[[], int]:
    return lambda: pid


def _summed_process_metrics(pids: list[int]) -> Iterator[Metric]:
    merged: dict[str, Metric] = {}
    for pid in pids:
        for family in ProcessCollector(registry=None, pid=_constant(pid)).collect():
            total = merged.get(family.name)
            if total is None:
                merged[family.name] = family
                continue
            pick = min if family.name in _EARLIEST else sum
            total.samples = [
                mine._replace(value=pick((mine.value, theirs.value)))
                for mine, theirs in zip(total.samples, family.samples, strict=False)
            ]
    yield from merged.values()
