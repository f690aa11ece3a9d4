"""The prefill leg: sent by pdproc itself, detached from the ext_proc stream.

A prefill must outlive the stream that launched it (the client may hang up, the decode may
finish first), so each runs in a task held by the launcher, not by the stream. Its response
is only checked; its outcome is counted, logged and handed to whoever still waits for it
(the stream holding the decode's response headers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from opentelemetry.trace import Span, SpanKind

from pdproc import mooncake
from pdproc.metrics import Metrics
from pdproc.targets import HostPort
from pdproc.telemetry import (
    ATTR_DURATION_MS,
    ATTR_ENGINE_ID,
    ATTR_PREFILL_OUTCOME,
    ATTR_RANK,
    ATTR_STATUS,
    ATTR_TARGET,
    ATTR_TRANSFER_ID,
    Tracing,
    fail,
)

log = logging.getLogger(__name__)

# Never copied onto the prefill request: pseudo-headers (":"-prefixed) are dropped as well,
# and so is anything pdproc sets itself.
_DROP_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "content-type",
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "accept-encoding",
        "x-prefiller-host-port",
        mooncake.RANK_HEADER,
    }
)


def prefill_headers(client_headers: Mapping[str, str], rank: int) -> dict[str, str]:
    """Headers for the prefill request: the client's end-to-end headers (authorization,
    x-request-id, trace context ...) minus hop-by-hop and routing ones, plus the dp rank."""
    headers = {
        name: value
        for name, value in client_headers.items()
        if not name.startswith((":", "x-envoy-")) and name not in _DROP_HEADERS
    }
    headers["content-type"] = "application/json"
    headers[mooncake.RANK_HEADER] = str(rank)
    return headers


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    outcome: str  # 2xx | 4xx | 5xx | timeout | connect_error | error
    duration_s: float
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "2xx"


@dataclass(frozen=True, slots=True)
class PrefillJob:
    target: HostPort
    rank: int
    engine_id: str
    transfer_id: str
    request_id: str
    path: str
    started: float
    task: asyncio.Task[PrefillOutcome]
    span: Span | None = None
    body_excerpt: str | None = None  # only with --log-bodies


OutcomeHook = Callable[[PrefillJob, PrefillOutcome], None]


class PrefillLauncher:
    def __init__(
        self,
        client: aiohttp.ClientSession,
        metrics: Metrics,
        *,
        timeout_s: float,
        on_outcome: OutcomeHook | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._on_outcome = on_outcome
        self._tracing = tracing or Tracing(None)
        self._tasks: set[asyncio.Task[PrefillOutcome]] = set()
        self._per_target: Counter[HostPort] = Counter()
        self._per_rank: dict[HostPort, Counter[int]] = {}

    def set_hook(self, on_outcome: OutcomeHook) -> None:
        self._on_outcome = on_outcome

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    def in_flight(self, target: HostPort) -> int:
        return self._per_target[target]

    def in_flight_by_rank(self, target: HostPort) -> Mapping[int, int]:
        return self._per_rank.get(target) or {}

    @property
    def total_in_flight(self) -> int:
        return len(self._tasks)

    def launch(
        self,
        *,
        target: HostPort,
        rank: int,
        engine_id: str,
        transfer_id: str,
        path: str,
        parsed: dict[str, Any],
        client_headers: Mapping[str, str],
        parent_span: Span | None = None,
        body_excerpt: str | None = None,
    ) -> PrefillJob:
        started = time.perf_counter()
        headers = prefill_headers(client_headers, rank)
        span = self._tracing.child_span(parent_span, "pdproc.prefill", SpanKind.CLIENT)
        if span is not None:
            span.set_attribute(ATTR_TARGET, str(target))
            span.set_attribute(ATTR_RANK, rank)
            span.set_attribute(ATTR_ENGINE_ID, engine_id)
            span.set_attribute(ATTR_TRANSFER_ID, transfer_id)
            self._tracing.inject(span, headers)
        self._per_target[target] += 1
        self._per_rank.setdefault(target, Counter())[rank] += 1
        self._metrics.prefills_in_flight.labels(str(target)).inc()
        # The body is built inside the task: off the request path, after the decode body has
        # been handed back to Envoy.
        coro = self._run(target, transfer_id, path, parsed, headers, started)
        task = asyncio.get_running_loop().create_task(coro, name=f"prefill {transfer_id}")
        job = PrefillJob(
            target,
            rank,
            engine_id,
            transfer_id,
            client_headers.get("x-request-id", ""),
            path,
            started,
            task,
            span,
            body_excerpt,
        )
        self._tasks.add(task)
        task.add_done_callback(lambda _: self._finished(job))
        return job

    async def _run(
        self,
        target: HostPort,
        transfer_id: str,
        path: str,
        parsed: dict[str, Any],
        headers: dict[str, str],
        started: float,
    ) -> PrefillOutcome:
        try:
            body = mooncake.prefill_body(path, parsed, mooncake.prefill_params(transfer_id))
            async with (
                asyncio.timeout(self._timeout_s),
                self._client.post(target.url() + path, data=body, headers=headers) as response,
            ):
                status, payload = response.status, await response.read()
        except TimeoutError:
            return PrefillOutcome(
                "timeout", time.perf_counter() - started, error=f"no answer in {self._timeout_s}s"
            )
        except aiohttp.ClientConnectorError as exc:
            return PrefillOutcome("connect_error", time.perf_counter() - started, error=str(exc))
        except aiohttp.ClientError as exc:
            return PrefillOutcome("error", time.perf_counter() - started, error=repr(exc))
        except Exception as exc:  # a bug must still end as a counted, logged outcome
            log.exception("prefill task crashed")
            return PrefillOutcome("error", time.perf_counter() - started, error=repr(exc))
        duration = time.perf_counter() - started
        if 200 <= status < 300:
            return PrefillOutcome("2xx", duration, status)
        detail = payload[:300].decode("utf-8", "replace")
        return PrefillOutcome(f"{status // 100}xx", duration, status, f"status {status}: {detail}")

    def _finished(self, job: PrefillJob) -> None:
        self._tasks.discard(job.task)
        self._per_target[job.target] -= 1
        if self._per_target[job.target] <= 0:
            del self._per_target[job.target]
        ranks = self._per_rank[job.target]
        ranks[job.rank] -= 1
        if ranks[job.rank] <= 0:
            del ranks[job.rank]
            if not ranks:
                del self._per_rank[job.target]
        self._metrics.prefills_in_flight.labels(str(job.target)).dec()
        if job.task.cancelled():
            outcome = PrefillOutcome("error", time.perf_counter() - job.started, error="cancelled")
        else:
            outcome = job.task.result()
        if job.span is not None:
            job.span.set_attribute(ATTR_PREFILL_OUTCOME, outcome.outcome)
            job.span.set_attribute(ATTR_DURATION_MS, round(outcome.duration_s * 1000, 3))
            if outcome.status is not None:
                job.span.set_attribute(ATTR_STATUS, outcome.status)
            if not outcome.ok:
                fail(job.span, outcome.error or outcome.outcome)
            job.span.end()
        self._metrics.prefills.labels(outcome.outcome).inc()
        self._metrics.prefill_seconds.observe(outcome.duration_s)
        fields = {
            "request_id": job.request_id,
            "transfer_id": job.transfer_id,
            "prefill_target": str(job.target),
            "dp_rank": job.rank,
            "engine_id": job.engine_id,
            "path": job.path,
            "prefill_outcome": outcome.outcome,
            "prefill_status": outcome.status,
            "prefill_ms": round(outcome.duration_s * 1000, 3),
        }
        if job.body_excerpt is not None:
            fields["body"] = job.body_excerpt
        if outcome.ok:
            log.info("pd request prefilled", extra=fields)
        else:
            log.warning("pd request prefill failed: %s", outcome.error, extra=fields)
        if self._on_outcome is not None:
            self._on_outcome(job, outcome)

    async def drain(self, timeout_s: float) -> int:
        """Wait for in-flight prefills (shutdown). Returns how many were still running."""
        pending = set(self._tasks)
        if pending:
            _, still = await asyncio.wait(pending, timeout=timeout_s)
            return len(still)
        return 0
