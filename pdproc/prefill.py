"""The prefill leg: sent by pdproc itself, detached from the ext_proc stream.

A prefill must outlive the stream that launched it (the client may hang up, the decode may
finish first), so each runs in a task held by the launcher, not by the stream. Its outcome
is its status line: known as soon as the pod answers, counted, logged and handed to
whoever still waits for it (the stream holding the decode's response headers). Of the
body only a bounded part is ever read, and redirects are never followed: the pod the
allow list admitted is the only one contacted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from opentelemetry.trace import Span, SpanKind

from pdproc.connectors import Legs
from pdproc.gateway_fields import GATEWAY_HEADERS
from pdproc.metrics import Metrics
from pdproc.outcomes import PrefillResult
from pdproc.pod_http import discard, locally_exhausted, peer_gone, read_at_most
from pdproc.request_body import Pieces
from pdproc.slots import Slots
from pdproc.targets import PREFILL_HEADER, HostPort
from pdproc.telemetry import (
    ATTR_DURATION_MS,
    ATTR_PREFILL_OUTCOME,
    ATTR_SERVER_ADDRESS,
    ATTR_SERVER_PORT,
    ATTR_STATUS,
    ATTR_TARGET,
    Tracing,
    fail,
    trace_fields,
)

log = logging.getLogger(__name__)

# Of an error answer, the start is kept for the log (with --log-bodies only: a pod's error
# may quote the prompt). Of a success, at most this much is read, so the connection can be
# reused; a pod that keeps sending is cut off.
ERROR_EXCERPT_BYTES = 512
MAX_SUCCESS_BODY_BYTES = 256 * 1024
# Sequential connectors read the answer itself: the decode's params, or an error the client
# sees as it is. Bounded all the same.
MAX_ANSWER_BYTES = 1024 * 1024
# Reading the rest of a successful answer never takes longer than this.
DRAIN_TIMEOUT_S = 5.0
# Of a successful answer that is otherwise only drained, the start is kept when the pool
# policy wants the pod's count of cached tokens (a one-token answer is well under 1 KiB).
USAGE_ANSWER_BYTES = 16 * 1024

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
        PREFILL_HEADER,
        *GATEWAY_HEADERS,
    }
)

# The first piece of a prefill body shorter than this is written with the request head.
_JOINED_WITH_HEAD = 64 * 1024

_OK = PrefillResult.OK  # (a module constant: enum attribute access is slow on Python 3.11)


def prefill_headers(
    client_headers: Mapping[str, str], connector_headers: Mapping[str, str]
) -> dict[str, str]:
    """Headers for the prefill request: the client's end-to-end headers (authorization,
    x-request-id, trace context ...) minus hop-by-hop and routing ones, plus the connector's
    own (the dp rank), which a client cannot override."""
    own = {name.lower() for name in connector_headers}
    headers = {
        name: value
        for name, value in client_headers.items()
        if not name.startswith((":", "x-envoy-")) and name not in _DROP_HEADERS and name not in own
    }
    headers["content-type"] = "application/json"
    headers.update(connector_headers)
    return headers


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    outcome: PrefillResult
    duration_s: float
    status: int | None = None
    error: str | None = None  # for the client and the log: never the pod's body
    detail: str | None = None  # the start of the pod's error body: logged with --log-bodies
    # The answer itself, when the connector asked for it (bounded by MAX_ANSWER_BYTES).
    answer: bytes | None = None
    content_type: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is _OK


class _SentOnce(aiohttp.Payload):
    """A prefill body written piece by piece (pdproc.request_body.Pieces: a long prompt is
    a view of the client's bytes, never joined here) and let go of once written: it is not
    held for the rest of the prefill (POST is never re-sent by aiohttp, so nothing writes it
    twice)."""

    def __init__(self, body: Pieces, sent: asyncio.Future[None]) -> None:
        super().__init__(body.parts, content_type="application/json")
        self._size = len(body)
        self._sent = sent

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def write(self, writer: aiohttp.abc.AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: aiohttp.abc.AbstractStreamWriter, content_length: int | None
    ) -> None:
        parts, self._value = list(self._value), ()
        # aiohttp joins the request head with the first piece written (one copy, one
        # syscall): right for a short piece, but a long prompt's head goes out on its own,
        # not as a copy of the prompt held until the pod has read it all.
        send_headers = getattr(writer, "send_headers", None)
        if send_headers is not None and parts and len(parts[0]) >= _JOINED_WITH_HEAD:
            send_headers()
        parts.reverse()
        try:
            while parts:
                await writer.write(parts.pop())
        finally:
            _resolve(self._sent)


def _resolve(sent: asyncio.Future[None]) -> None:
    if not sent.done():
        sent.set_result(None)


@dataclass(slots=True)
class PrefillJob:
    target: HostPort
    # Without its bodies: the prefill's is sent (then dropped) by the task, the decode's went
    # to Envoy.
    legs: Legs
    request_id: str
    path: str
    started: float
    outcome: asyncio.Future[PrefillOutcome]  # resolved at the status line (or the answer)
    keep_answer: bool = False
    task: asyncio.Task[None] | None = None  # the whole exchange (bounded read included)
    span: Span | None = None
    log_fields: dict[str, Any] = field(default_factory=dict)
    # Resolved once the prefill body is written to the pod, or can no longer be (the
    # exchange ended first): until then its pieces, views of the client's body, are held.
    body_sent: asyncio.Future[None] | None = None


OutcomeHook = Callable[[PrefillJob, PrefillOutcome], None]
# A successful answer's start (at most USAGE_ANSWER_BYTES), once read after its status line.
AnswerHook = Callable[[PrefillJob, bytes], None]


class PrefillLauncher:
    def __init__(
        self,
        client: aiohttp.ClientSession,
        metrics: Metrics,
        *,
        timeout_s: float,
        tracing: Tracing | None = None,
        log_bodies: bool = False,
        on_outcome: OutcomeHook | None = None,
        on_answer: AnswerHook | None = None,
        slots: Slots | None = None,
        named_host: Callable[[HostPort], str | None] = lambda target: None,
    ) -> None:
        """`on_outcome` is told every prefill's outcome once it is known (after it has been
        counted and logged): what it teaches about the pod (breakers, engine maps).
        `on_answer` is given the start of each successful answer that is otherwise only
        drained (the pod's own count of cached tokens is in it).
        `slots` bound pdproc's connections (`named_host`: the host of a target only a
        request header named, None for a pool member)."""
        self._client = client
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._tracing = tracing or Tracing(None)
        self._log_bodies = log_bodies
        self._on_outcome = on_outcome
        self._on_answer = on_answer
        self._slots = slots or Slots(1 << 30, 1 << 30)
        self._named_host = named_host
        self._tasks: set[asyncio.Task[None]] = set()
        self._per_target: Counter[HostPort] = Counter()
        self._per_rank: dict[HostPort, Counter[int]] = {}

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    def in_flight(self, target: HostPort) -> int:
        return self._per_target[target]

    def in_flight_by_rank(self, target: HostPort) -> Mapping[int, int]:
        return self._per_rank.get(target) or {}

    def launch(
        self,
        *,
        target: HostPort,
        legs: Legs,
        path: str,
        client_headers: Mapping[str, str],
        parent_span: Span | None = None,
        log_fields: Mapping[str, Any] | None = None,
        keep_answer: bool = False,
    ) -> PrefillJob:
        loop = asyncio.get_running_loop()
        headers = prefill_headers(client_headers, legs.prefill_headers)
        span = self._tracing.child_span(parent_span, "pdproc.prefill", SpanKind.CLIENT)
        if span is not None:
            span.set_attribute(ATTR_TARGET, str(target))
            span.set_attribute(ATTR_SERVER_ADDRESS, target.host)
            span.set_attribute(ATTR_SERVER_PORT, target.port)
            for key, value in legs.facts.items():
                span.set_attribute(f"pdproc.{key}", value)
            self._tracing.inject(span, headers)
        sent: asyncio.Future[None] = loop.create_future()
        body = _SentOnce(legs.prefill_body, sent)
        job = PrefillJob(
            target,
            # Built, not dataclasses.replace()d: a third of the cost, on every request.
            Legs(
                prefill_body=Pieces(()),
                decode_body=None,
                prefill_headers=legs.prefill_headers,
                rank=legs.rank,
                facts=legs.facts,
            ),
            client_headers.get("x-request-id", ""),
            path,
            time.perf_counter(),
            loop.create_future(),
            keep_answer=keep_answer,
            span=span,
            log_fields={**(log_fields or {}), **trace_fields(parent_span)},
            body_sent=sent,
        )
        self._per_target[target] += 1
        if legs.rank is not None:
            self._per_rank.setdefault(target, Counter())[legs.rank] += 1
        self._metrics.prefill_started(target)
        job.outcome.add_done_callback(lambda _: self._finished(job))
        task = loop.create_task(
            self._exchange(job, headers, body), name=f"prefill {job.request_id}"
        )
        job.task = task
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._ended(job, done))
        return job

    def _ended(self, job: PrefillJob, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if job.body_sent is not None:
            _resolve(job.body_sent)
        if not job.outcome.done():
            # Cancelled before its first step (the stream ended in the loop turn that
            # launched it): the exchange never ran to settle it, so it is settled here.
            duration = time.perf_counter() - job.started
            job.outcome.set_result(
                PrefillOutcome(PrefillResult.CANCELLED, duration, error="prefill cancelled")
            )

    async def _exchange(
        self, job: PrefillJob, headers: dict[str, str], body: aiohttp.Payload
    ) -> None:
        """Wait for a connection slot (pdproc's own: not inside the pod's timeout), then
        send the prefill."""
        named = self._named_host(job.target)
        if not await self._slots.take(named, self._timeout_s):
            _settle(job, PrefillResult.EXHAUSTED, error="no free prefill connection at pdproc")
            return
        try:
            job.started = time.perf_counter()
            await self._send(job, headers, body)
        finally:
            self._slots.give_back(named)

    async def _send(self, job: PrefillJob, headers: dict[str, str], body: aiohttp.Payload) -> None:
        url = job.target.url() + job.path
        try:
            async with asyncio.timeout(self._timeout_s) as deadline:
                response = await self._client.post(
                    url, data=body, headers=headers, allow_redirects=False
                )
                async with response:
                    kept = await _read_answer(job, response, deadline, self._on_answer is not None)
            if kept is not None and self._on_answer is not None:
                self._on_answer(job, kept)
        except aiohttp.ConnectionTimeoutError as exc:
            # No connection within its bound (a silent node): the pod is down, no timeout.
            _settle(job, PrefillResult.CONNECT_ERROR, error=str(exc) or "connect timed out")
        except TimeoutError:
            _settle(job, PrefillResult.TIMEOUT, error=f"no answer in {self._timeout_s:g}s")
        except (aiohttp.ClientError, OSError) as exc:
            kind, error = _client_failure(exc)
            _settle(job, kind, error=error)
        except asyncio.CancelledError:
            _settle(job, PrefillResult.CANCELLED, error="prefill cancelled")
            raise
        except Exception as exc:  # a bug must still end as a counted, logged outcome
            log.exception("prefill task crashed")
            _settle(job, PrefillResult.INTERNAL, error=f"internal error: {type(exc).__name__}")

    def _finished(self, job: PrefillJob) -> None:
        left = self._release(job)
        self._metrics.prefill_finished(job.target, max(left, 0))
        outcome = job.outcome.result()
        if job.span is not None:
            _end_span(job.span, outcome)
        self._metrics.prefill_ended(outcome.outcome)
        self._metrics.prefill_seconds.observe(outcome.duration_s)
        self._log_outcome(job, outcome)
        if self._on_outcome is not None:
            self._on_outcome(job, outcome)

    def _release(self, job: PrefillJob) -> int:
        """Take the finished job off its target's (and rank's) count; what its target has left."""
        self._per_target[job.target] -= 1
        left = self._per_target[job.target]
        if left <= 0:
            del self._per_target[job.target]
        rank = job.legs.rank
        if rank is not None:
            ranks = self._per_rank[job.target]
            ranks[rank] -= 1
            if ranks[rank] <= 0:
                del ranks[rank]
                if not ranks:
                    del self._per_rank[job.target]
        return left

    def _log_outcome(self, job: PrefillJob, outcome: PrefillOutcome) -> None:
        fields = {
            "request_id": job.request_id,
            "prefill_target": str(job.target),
            **job.legs.facts,
            "path": job.path,
            "prefill_outcome": outcome.outcome.value,
            "prefill_status": outcome.status,
            "prefill_ms": round(outcome.duration_s * 1000, 3),
            **job.log_fields,
        }
        if outcome.ok:
            log.info("pd request prefilled", extra=fields)
        else:
            if self._log_bodies and outcome.detail:
                fields["prefill_error_body"] = outcome.detail
            log.warning("pd request prefill failed: %s", outcome.error, extra=fields)

    async def drain(self, timeout_s: float) -> int:
        """Wait for in-flight prefills (shutdown). Returns how many were still running."""
        pending = set(self._tasks)
        if pending:
            _, still = await asyncio.wait(pending, timeout=timeout_s)
            return len(still)
        return 0


def _settle(job: PrefillJob, outcome: PrefillResult, **kw: Any) -> None:
    """Give the job its outcome, unless something settled it first."""
    if not job.outcome.done():
        duration = time.perf_counter() - job.started
        job.outcome.set_result(PrefillOutcome(outcome, duration, **kw))


async def _read_answer(
    job: PrefillJob, response: aiohttp.ClientResponse, deadline: asyncio.Timeout, keep: bool
) -> bytes | None:
    """Settle the job from the prefill's answer; with `keep`, the start of a successful
    answer that is otherwise drained is returned (None when it was longer)."""
    status = response.status
    if job.keep_answer and not 300 <= status < 400:
        await _keep_answer(job, response)
    elif 200 <= status < 300:
        _settle(job, PrefillResult.OK, status=status)
        # Read the (small) rest so the connection can be reused: bounded in size and time,
        # and the outcome is already known.
        deadline.reschedule(min(deadline.when() or 0.0, _now() + DRAIN_TIMEOUT_S))
        if not keep:
            await discard(response.content, MAX_SUCCESS_BODY_BYTES)
            return None
        start = await read_at_most(response.content, USAGE_ANSWER_BYTES)
        if len(start) <= USAGE_ANSWER_BYTES:
            return start
        await discard(response.content, MAX_SUCCESS_BODY_BYTES - len(start))
    else:
        await _settle_refusal(job, response)
    return None


async def _keep_answer(job: PrefillJob, response: aiohttp.ClientResponse) -> None:
    """Settle with the whole (bounded) answer, for a connector that reads it."""
    status = response.status
    answer = await read_at_most(response.content, MAX_ANSWER_BYTES)
    if len(answer) > MAX_ANSWER_BYTES:
        _settle(job, PrefillResult.ERROR, status=status, error="answer too large")
        return
    kind = PrefillResult.of_status(status)
    _settle(
        job,
        kind,
        status=status,
        error=None if kind is PrefillResult.OK else f"status {status}",
        answer=answer,
        content_type=response.headers.get("content-type"),
    )


async def _settle_refusal(job: PrefillJob, response: aiohttp.ClientResponse) -> None:
    """Settle a non-2xx answer with its status and the start of its body."""
    status = response.status
    excerpt = await response.content.read(ERROR_EXCERPT_BYTES)
    kind = PrefillResult.of_status(status)
    note = " (redirects are not followed)" if kind is PrefillResult.REDIRECT else ""
    _settle(
        job,
        kind,
        status=status,
        error=f"status {status}{note}",
        detail=excerpt.decode("utf-8", "replace"),
    )


def _client_failure(exc: aiohttp.ClientError | OSError) -> tuple[PrefillResult, str]:
    """What a failed connection or exchange says: pdproc's own exhaustion, a pod that cannot
    be reached, or another error."""
    if locally_exhausted(exc):
        return PrefillResult.EXHAUSTED, f"pdproc is out of resources: {exc}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return PrefillResult.CONNECT_ERROR, str(exc)
    if peer_gone(exc):
        return PrefillResult.DEAD_PEER, f"the pod stopped acknowledging: {exc}"
    return PrefillResult.ERROR, type(exc).__name__


def _end_span(span: Span, outcome: PrefillOutcome) -> None:
    span.set_attribute(ATTR_PREFILL_OUTCOME, outcome.outcome.value)
    span.set_attribute(ATTR_DURATION_MS, round(outcome.duration_s * 1000, 3))
    if outcome.status is not None:
        span.set_attribute(ATTR_STATUS, outcome.status)
    if not outcome.ok:
        fail(span, outcome.error or outcome.outcome.value)
    span.end()


def _now() -> float:
    return asyncio.get_running_loop().time()
