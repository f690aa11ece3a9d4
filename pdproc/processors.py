"""Per-request processors: one method per ext_proc phase, each returning its answer.

The stream picks one processor per request when the request's headers arrive:

- `PassThrough` (a null object): not a P/D request; Envoy stops sending anything more.
- `Rejected`: refused at the door (bad prefill header, forbidden target, pod known down).
- `DecodeOnly`: a P/D path served by the decode alone (no prefill target, draining, or
  `--on-bootstrap-error decode-only`); its body is still checked.
- `Disaggregated`: the P/D pair; the connector builds both legs, the prefill is launched
  and the decode's response headers wait for its outcome.

Every request ends in exactly one outcome, counted by its `RequestContext`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from opentelemetry.trace import Span

from pdproc import envoy_messages as msg
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc.breaker import POD_DOWN
from pdproc.config import BootstrapPolicy
from pdproc.connectors import ClientRequest, EngineMap, OnFailure
from pdproc.connectors.mooncake import BootstrapError
from pdproc.errors import ErrorKind, ErrorReply
from pdproc.prefill import PrefillJob, PrefillOutcome
from pdproc.request_body import BodyError, parse_body
from pdproc.targets import HostPort
from pdproc.telemetry import ATTR_CONNECTOR, ATTR_OUTCOME, ATTR_TARGET, fail, trace_fields

if TYPE_CHECKING:
    from pdproc.service import ExtProcService

log = logging.getLogger(__name__)

BODY_LOG_BYTES = 4096
_OVERLOADED = ErrorReply(
    ErrorKind.OVERLOADED, "too many request bytes in flight at this gateway; retry later"
)


@dataclass(frozen=True, slots=True)
class Deferred:
    """An answer that comes later. Envoy gives up on it after its message_timeout, so if it
    is not ready `hold_after` seconds from now, `hold` (a longer timeout) is written first:
    the usual short wait costs no extra message."""

    later: Awaitable[msg.Response]
    hold: msg.Response
    hold_after: float


Answer: TypeAlias = "msg.Response | Deferred"
Abort = Callable[[msg.Response], None]


class RequestContext:
    """What every processor of one request shares: who it is, its span, its one outcome."""

    def __init__(
        self,
        service: ExtProcService,
        headers: Mapping[str, str],
        path: str,
        span: Span | None,
        *,
        single_message: bool,
    ) -> None:
        self.service = service
        self.headers = headers
        self.path = path
        self.span = span
        self.single_message = single_message
        self.request_id = headers.get("x-request-id", "")
        self._counted = False

    def finish(self, outcome: str) -> None:
        """Count the request's outcome, once."""
        if self._counted:
            return
        self._counted = True
        self.service.count(self.path, outcome)
        if self.span is not None and self.span.is_recording():
            self.span.set_attribute(ATTR_OUTCOME, outcome)

    def log_fields(self, **more: Any) -> dict[str, Any]:
        return {"request_id": self.request_id, "path": self.path, **trace_fields(self.span), **more}

    def reject(self, reply: ErrorReply) -> msg.Response:
        """Answer the request in Envoy's place; the request ends here and is counted here."""
        self.finish(reply.kind.value)
        fail(self.span, reply.message)
        log.warning(
            "request rejected: %s",
            reply.message,
            extra=self.log_fields(outcome=reply.kind.value, status=reply.status),
        )
        return msg.immediate(reply)

    def close(self) -> None:
        if self.span is not None:
            self.span.end()


class RequestProcessor(Protocol):
    context: RequestContext

    def request_headers(self) -> Answer: ...

    async def request_body(self, body: pb.HttpBody) -> Answer: ...

    def response_headers(self, headers: pb.HttpHeaders) -> Answer: ...

    def close(self) -> None: ...


class PassThrough:
    """Not a P/D request: let everything through, and have Envoy send nothing more."""

    def __init__(self, context: RequestContext) -> None:
        self.context = context
        context.finish("passthrough")

    def request_headers(self) -> Answer:
        return msg.PASS_THROUGH_HEADERS

    async def request_body(self, body: pb.HttpBody) -> Answer:
        return msg.CONTINUE_REQUEST_BODY

    def response_headers(self, headers: pb.HttpHeaders) -> Answer:
        return msg.CONTINUE_RESPONSE_HEADERS

    def close(self) -> None:
        self.context.close()


class Rejected(PassThrough):
    """Refused before its body was read (in single-message mode: when it arrives)."""

    def __init__(self, context: RequestContext, reply: ErrorReply) -> None:
        self.context = context
        self._reply = reply

    def request_headers(self) -> Answer:
        return self.context.reject(self._reply)

    async def request_body(self, body: pb.HttpBody) -> Answer:
        return self.context.reject(self._reply)


class _BodyChecks:
    """The checks every P/D-path body passes before anything is done with it."""

    context: RequestContext

    def _checked(self, body: pb.HttpBody) -> ClientRequest | ErrorReply:
        service = self.context.service
        if not body.end_of_stream:
            # Only BUFFERED delivers the whole body at once; a partial body means it outgrew
            # Envoy's buffer (BUFFERED_PARTIAL) and cannot be checked or rewritten.
            return ErrorReply(ErrorKind.TOO_LARGE, "request body too large to buffer")
        raw = body.body
        limit = service.settings.max_body_bytes
        if len(raw) > limit:
            return ErrorReply(ErrorKind.TOO_LARGE, f"request body exceeds {limit} bytes")
        try:
            return ClientRequest(self.context.path, raw, parse_body(raw), self.context.request_id)
        except BodyError as exc:
            return ErrorReply(ErrorKind.BAD_REQUEST, str(exc))


class DecodeOnly(_BodyChecks, PassThrough):
    """A P/D path the decode serves alone; the body is still checked (no client params)."""

    def __init__(self, context: RequestContext, outcome: str, reason: str | None = None) -> None:
        self.context = context
        self._outcome = outcome
        self._reason = reason

    def request_headers(self) -> Answer:
        return msg.CHECK_BODY_ONLY_HEADERS

    async def request_body(self, body: pb.HttpBody) -> Answer:
        with self.context.service.body_budget(len(body.body)) as admitted:
            checked = self._checked(body) if admitted else _OVERLOADED
            if isinstance(checked, ErrorReply):
                return self.context.reject(checked)
            return self.served_alone()

    def served_alone(self) -> msg.Response:
        """The client's own body goes on to the decode, marked as checked."""
        if self._reason is not None:
            log.warning(
                "decode-only fallback: %s",
                self._reason,
                extra=self.context.log_fields(outcome=self._outcome),
            )
        self.context.finish(self._outcome)
        return msg.CHECKED_REQUEST_BODY


class Disaggregated(_BodyChecks):
    """The P/D pair: prefill launched by pdproc, decode carried by Envoy."""

    def __init__(
        self, context: RequestContext, target: HostPort, abort: Abort, *, min_prompt: int = 0
    ) -> None:
        self.context = context
        self._target = target
        self._abort = abort
        self._min_prompt = min_prompt
        self._job: PrefillJob | None = None
        self._response_seen = False
        self._busy_s = 0.0
        if context.span is not None:
            context.span.set_attribute(ATTR_TARGET, str(target))
            context.span.set_attribute(ATTR_CONNECTOR, context.service.connector.name)

    def request_headers(self) -> Answer:
        started = time.perf_counter()
        service = self.context.service
        if service.connector.uses_engines:
            # Overlap a cache miss with Envoy sending the body.
            service.engines.prefetch(self._target, self.context.span)
        self._busy_s += time.perf_counter() - started
        return msg.CONTINUE_REQUEST_HEADERS

    async def request_body(self, body: pb.HttpBody) -> Answer:
        with self.context.service.body_budget(len(body.body)) as admitted:
            return await self._disaggregate(body) if admitted else self.context.reject(_OVERLOADED)

    async def _disaggregate(self, body: pb.HttpBody) -> Answer:
        started = time.perf_counter()
        service = self.context.service
        checked = self._checked(body)
        if isinstance(checked, ErrorReply):
            return self.context.reject(checked)
        if len(checked.raw) < self._min_prompt:
            # Too short for P/D to pay: the decode does it all (--pd-min-prompt).
            return DecodeOnly(self.context, "short_prompt").served_alone()
        engines: EngineMap | None = None
        if service.connector.uses_engines:
            try:
                engines = await service.engines.get(self._target, self.context.span)
            except BootstrapError as exc:
                service.breakers.record(self._target, POD_DOWN if exc.pod_down else "bootstrap")
                return self._without_prefill(ErrorReply(ErrorKind.BOOTSTRAP, str(exc)))
        busy = service.launcher.in_flight_by_rank(self._target)
        try:
            legs = service.connector.legs(checked, self._target, engines, busy)
        except BodyError as exc:
            return self.context.reject(ErrorReply(ErrorKind.BAD_REQUEST, str(exc)))
        excerpt = {}
        if service.settings.log_bodies:
            excerpt["body"] = checked.raw[:BODY_LOG_BYTES].decode("utf-8", "replace")
        sequential = service.connector.sequential
        job = self._job = service.launcher.launch(
            target=self._target,
            legs=legs,
            path=self.context.path,
            client_headers=self.context.headers,
            parent_span=self.context.span,
            log_fields=excerpt,
            keep_answer=sequential,
        )
        if self.context.span is not None:
            for key, value in legs.facts.items():
                self.context.span.set_attribute(f"pdproc.{key}", value)
        self._busy_s += time.perf_counter() - started
        service.metrics.processing_seconds.observe(self._busy_s)
        if sequential or legs.decode_body is None:
            # The body's answer waits for the prefill (Envoy is told to wait if it must).
            return self._deferred(job, self._after_prefill(job, checked))
        job.outcome.add_done_callback(self._prefill_done)
        return self._decode(legs.decode_body)

    def _decode(self, body: bytes) -> msg.Response:
        return msg.body_response(body, content_length=not self.context.single_message)

    def _deferred(self, job: PrefillJob, later: Awaitable[msg.Response]) -> Deferred:
        """An answer that waits for the prefill. The override asking Envoy to wait is sized
        for the rest of the prefill (Envoy honours only the first per message, capped at
        the filter's max_message_timeout), and only sent when the wait nears Envoy's
        message_timeout."""
        settings = self.context.service.settings
        remaining = self.context.service.launcher.timeout_s - (time.perf_counter() - job.started)
        hold = msg.hold(min(max(remaining, 0.0) + 1.0, settings.envoy_max_message_timeout))
        # Leave the override time to reach Envoy before its own timer fires.
        timeout = settings.envoy_message_timeout
        return Deferred(later, hold, hold_after=max(timeout - 2.0, timeout / 2))

    async def _after_prefill(self, job: PrefillJob, request: ClientRequest) -> msg.Response:
        """Sequential connectors: the decode leg once the prefill has answered."""
        outcome = await asyncio.shield(job.outcome)
        connector = self.context.service.connector
        if outcome.ok and outcome.answer is not None:
            try:
                body = connector.decode_body(request, outcome.answer)
            except BodyError as exc:
                return self._alone(f"unusable prefill answer: {exc}")
            self.context.finish("pd")
            return self._decode(body)
        reply = prefill_error(outcome)
        if connector.on_failure(outcome.status) is OnFailure.PASS_THROUGH:
            self.context.finish(reply.kind.value)
            return msg.passed_through(
                outcome.status or 502, outcome.answer or b"", outcome.content_type
            )
        return self._alone(reply.message)

    def _alone(self, reason: str) -> msg.Response:
        return DecodeOnly(self.context, "decode_only", reason).served_alone()

    def _without_prefill(self, reply: ErrorReply) -> Answer:
        """No prefill can serve this request: reject it, or let the decode do it alone."""
        if self.context.service.settings.on_bootstrap_error is BootstrapPolicy.REJECT:
            return self.context.reject(reply)
        return self._alone(reply.message)

    def _prefill_done(self, outcome: asyncio.Future[PrefillOutcome]) -> None:
        """Count the request; a failure seen before the decode answered aborts it at once."""
        result = outcome.result()
        self.context.finish("pd" if result.ok else prefill_error(result).kind.value)
        if not result.ok and not self._response_seen:
            self._abort(self._aborted(result, "before_response"))

    def response_headers(self, headers: pb.HttpHeaders) -> Answer:
        self._response_seen = True
        job = self._job
        if job is None:
            return msg.CONTINUE_RESPONSE_HEADERS
        status = msg.status_of(headers)
        if status.startswith("5"):
            # A decode 5xx may be a stale engine id (the prefill pod restarted): re-query.
            self.context.service.engines.invalidate(job.target)
        if self.context.service.connector.sequential:
            return msg.CONTINUE_RESPONSE_HEADERS  # the prefill ended before the decode began
        if job.outcome.done():
            return self._settled(job.outcome.result(), "before_response")
        if not status.startswith("2"):
            # The decode failed on its own: the client sees its error; the prefill carries on.
            return msg.CONTINUE_RESPONSE_HEADERS
        return self._deferred(job, self._held(job))

    async def _held(self, job: PrefillJob) -> msg.Response:
        started = time.perf_counter()
        outcome = await asyncio.shield(job.outcome)
        self.context.service.metrics.hold_seconds.observe(time.perf_counter() - started)
        return self._settled(outcome, "held")

    def _settled(self, outcome: PrefillOutcome, when: str) -> msg.Response:
        if outcome.ok:
            return msg.CONTINUE_RESPONSE_HEADERS
        return self._aborted(outcome, when)

    def _aborted(self, outcome: PrefillOutcome, when: str) -> msg.Response:
        """The one abort path: the decode is cancelled and the client gets the error."""
        self.context.service.metrics.aborts.labels(when).inc()
        fail(self.context.span, outcome.error or outcome.outcome)
        return msg.immediate(prefill_error(outcome))

    def close(self) -> None:
        job = self._job
        sequential = self.context.service.connector.sequential
        if sequential and job is not None and job.task is not None and not job.outcome.done():
            # Nobody will use this prefill's KV: free the prefill pod's work and blocks.
            job.task.cancel()
            self.context.finish("cancelled")
        self.context.close()


def prefill_error(outcome: PrefillOutcome) -> ErrorReply:
    if outcome.outcome == "timeout":
        return ErrorReply(ErrorKind.PREFILL_TIMEOUT, f"prefill timed out: {outcome.error}")
    return ErrorReply(ErrorKind.PREFILL_FAILED, f"prefill failed: {outcome.error}")
