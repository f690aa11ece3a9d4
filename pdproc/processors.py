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
from pdproc.connectors import (
    AnswerError,
    ClientRequest,
    Concurrent,
    EngineMap,
    Legs,
    NoKvParams,
    OnFailure,
)
from pdproc.connectors.mooncake import BootstrapError
from pdproc.errors import ErrorKind, ErrorReply
from pdproc.prefill import EXHAUSTED, PrefillJob, PrefillOutcome
from pdproc.request_body import BodyError, members, parse_body
from pdproc.streamed_body import TAIL, StreamedBody, parse_content_length
from pdproc.targets import HostPort
from pdproc.telemetry import (
    ATTR_CONNECTOR,
    ATTR_OUTCOME,
    ATTR_STREAMED,
    ATTR_TARGET,
    fail,
    trace_fields,
)

if TYPE_CHECKING:
    from pdproc.service import ExtProcService

log = logging.getLogger(__name__)

BODY_LOG_BYTES = 4096
_OVERLOADED = ErrorReply(
    ErrorKind.OVERLOADED, "too many request bytes in flight at this gateway; retry later"
)
_TRAILERS = ErrorReply(ErrorKind.BAD_REQUEST, "request trailers are not supported on P/D paths")
# Outcome of a streamed request answered before pdproc saw its body end.
UNFINISHED = "unfinished_body"
# The client left (its stream ended) before the decode's answer reached it, and no prefill
# of its was running (none launched yet, or already finished).
ABANDONED = "abandoned"
# The same, with its prefill still running: pdproc cancelled it (nobody will use its KV).
CANCELLED = "cancelled"
# Outcome of a request whose prefill answered what the decode may not be given (NIXL: a side
# channel outside the allow list, wrong types or sizes): the decode serves it alone.
REFUSED_ANSWER = "prefill_answer_refused"


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
        id_replaced: bool = False,
    ) -> None:
        self.service = service
        self.headers = headers
        self.path = path
        self.span = span
        self.single_message = single_message
        # pdproc's id for the request (pdproc.request_ids): the client's x-request-id, or one
        # pdproc minted in place of an unfit value (`id_replaced`).
        self.request_id = headers.get("x-request-id", "")
        self.id_replaced = id_replaced
        self.finished = False

    def finish(self, outcome: str) -> None:
        """Count the request's outcome, once."""
        if self.finished:
            return
        self.finished = True
        self.service.count(self.path, outcome)
        if self.span is not None and self.span.is_recording():
            self.span.set_attribute(ATTR_OUTCOME, outcome)

    def held_request_id(self) -> str | None:
        """The id to set on the decode leg: pdproc's, when it replaced the client's and
        Envoy still holds the request headers (two-message mode)."""
        return self.request_id if self.id_replaced and not self.single_message else None

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

    async def request_headers(self) -> Answer: ...

    async def request_body(self, body: pb.HttpBody) -> Answer: ...

    def request_trailers(self) -> Answer: ...

    def response_headers(self, headers: pb.HttpHeaders) -> Answer: ...

    def close(self, *, abandoned: bool) -> None:
        """The stream ended; `abandoned`: before the decode's answer went to the client."""


class PassThrough:
    """Not a P/D request: let everything through, and have Envoy send nothing more."""

    def __init__(self, context: RequestContext) -> None:
        self.context = context
        context.finish("passthrough")

    async def request_headers(self) -> Answer:
        return msg.PASS_THROUGH_HEADERS

    async def request_body(self, body: pb.HttpBody) -> Answer:
        return msg.CONTINUE_REQUEST_BODY

    def request_trailers(self) -> Answer:
        return msg.CONTINUE_REQUEST_TRAILERS

    def response_headers(self, headers: pb.HttpHeaders) -> Answer:
        return msg.CONTINUE_RESPONSE_HEADERS

    def close(self, *, abandoned: bool) -> None:
        if abandoned:
            self.context.finish(ABANDONED)  # unless it was counted already
        self.context.close()


class Rejected(PassThrough):
    """Refused before its body was read (in single-message mode: when it arrives)."""

    def __init__(self, context: RequestContext, reply: ErrorReply) -> None:
        self.context = context
        self._reply = reply

    async def request_headers(self) -> Answer:
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

    async def request_headers(self) -> Answer:
        return msg.CHECK_BODY_ONLY_HEADERS

    async def request_body(self, body: pb.HttpBody) -> Answer:
        with self.context.service.body_budget(len(body.body)) as admitted:
            checked = self._checked(body) if admitted else _OVERLOADED
            if isinstance(checked, ErrorReply):
                return self.context.reject(checked)
            return self.served_alone()

    def served_alone(self) -> msg.Response:
        """The client's own body goes on to the decode, marked as checked."""
        self.record()
        return msg.checked_request_body(self.context.held_request_id())

    def record(self) -> None:
        """Count (and log, if it is a fallback) that the decode serves this request alone."""
        if self._reason is not None:
            log.warning(
                "decode-only fallback: %s",
                self._reason,
                extra=self.context.log_fields(outcome=self._outcome),
            )
        self.context.finish(self._outcome)


class Disaggregated(_BodyChecks):
    """The P/D pair: prefill launched by pdproc, decode carried by Envoy."""

    def __init__(
        self,
        context: RequestContext,
        target: HostPort,
        abort: Abort,
        *,
        min_prompt: int = 0,
    ) -> None:
        self.context = context
        self._target = target
        self._abort = abort
        self._min_prompt = min_prompt
        self._job: PrefillJob | None = None
        self._streamed: StreamedBody | None = None
        # Body bytes a streamed request holds against --max-inflight-bytes until its end:
        # those that arrived, chunk by chunk (pdproc.budget).
        self._budget = context.service.budget.holding()
        self._response_seen = False
        self._busy_s = 0.0
        if context.span is not None:
            context.span.set_attribute(ATTR_TARGET, str(target))
            context.span.set_attribute(ATTR_CONNECTOR, context.service.connector.name)

    async def request_headers(self) -> Answer:
        started = time.perf_counter()
        service = self.context.service
        if service.connector.uses_engines:
            # Overlap a cache miss with Envoy sending the body.
            service.engines.prefetch(self._target, self.context.span)
        length = self._streamable_length()
        answer = msg.CONTINUE_REQUEST_HEADERS if length is None else self._stream(length)
        self._busy_s += time.perf_counter() - started
        return answer

    def _streamable_length(self) -> int | None:
        """The body's length when it is to be streamed (pdproc.streamed_body), else None."""
        service = self.context.service
        threshold = service.settings.stream_body_bytes
        if not threshold or self.context.single_message:
            return None  # single-message mode has no headers answer to switch modes in
        if not isinstance(service.connector, Concurrent):
            return None  # the decode leg is built from the prefill's answer
        length = parse_content_length(self.context.headers.get("content-length"))
        if length is None or length < max(threshold, TAIL + 1, self._min_prompt):
            return None
        if length > service.settings.max_body_bytes:
            return None  # buffered, it gets Envoy's 413 or pdproc's
        return length

    def _stream(self, length: int) -> msg.Response:
        """Have Envoy stream the body past pdproc; its bytes count against the in-flight
        budget as they arrive, until its end. The announced length reserves nothing."""
        service = self.context.service
        if service.budget.full:
            return self.context.reject(_OVERLOADED)
        self._streamed = StreamedBody(length)
        if self.context.span is not None:
            self.context.span.set_attribute(ATTR_STREAMED, True)
        service.metrics.streamed_bodies.inc()
        return msg.STREAMED_HEADERS

    async def request_body(self, body: pb.HttpBody) -> Answer:
        if self._streamed is not None:
            return await self._stream_chunk(body, self._streamed)
        with self.context.service.body_budget(len(body.body)) as admitted:
            return await self._disaggregate(body) if admitted else self.context.reject(_OVERLOADED)

    async def _stream_chunk(self, body: pb.HttpBody, streamed: StreamedBody) -> Answer:
        """A chunk of a streamed body: on at once, except the held-back tail."""
        if not self._budget.grow(len(body.body)):
            return self._stream_refused(_OVERLOADED)
        try:
            data = streamed.feed(body.body, body.end_of_stream)
        except BodyError as exc:
            return self._stream_refused(ErrorReply(ErrorKind.BAD_REQUEST, str(exc)))
        if not body.end_of_stream:
            return msg.chunk_response(data)
        try:
            return await self._stream_end(streamed)
        finally:
            self._budget.release()

    def _stream_refused(self, reply: ErrorReply) -> msg.Response:
        """A streamed body refused before its end: its bytes leave the budget now."""
        self._budget.release()
        return self.context.reject(reply)

    def request_trailers(self) -> Answer:
        if self._streamed is not None and not self.context.finished:
            # Only a chunk marked as the body's last can carry its rewritten end.
            return self._stream_refused(_TRAILERS)
        return msg.CONTINUE_REQUEST_TRAILERS

    async def _stream_end(self, streamed: StreamedBody) -> msg.Response:
        """The whole body is in: check it, plan and launch the prefill, release the tail
        with the decode's fields. A refusal here cuts the decode off mid-body."""
        started = time.perf_counter()
        service = self.context.service
        connector = service.connector
        assert isinstance(connector, Concurrent)
        raw = streamed.whole()
        try:
            request = ClientRequest(
                self.context.path, raw, parse_body(raw), self.context.request_id
            )
        except BodyError as exc:
            return self.context.reject(ErrorReply(ErrorKind.BAD_REQUEST, str(exc)))
        empty = not request.parsed
        engines: EngineMap | None = None
        if connector.uses_engines:
            try:
                engines = await service.engines.get(self._target, self.context.span)
            except BootstrapError as exc:
                if exc.local:
                    return self.context.reject(_exhausted(exc))
                service.breakers.record(self._target, POD_DOWN if exc.pod_down else "bootstrap")
                reply = ErrorReply(ErrorKind.BOOTSTRAP, str(exc))
                if service.settings.on_bootstrap_error is BootstrapPolicy.REJECT:
                    return self.context.reject(reply)
                DecodeOnly(self.context, "decode_only", reply.message).record()
                return msg.last_chunk_response(streamed.tail(raw, b"", empty_object=empty))
        plan = connector.plan(
            self._target, engines, service.launcher.in_flight_by_rank(self._target)
        )
        try:
            legs = connector.build(request, plan, decode=False)
            tail = streamed.tail(raw, members(plan.decode_fields), empty_object=empty)
        except BodyError as exc:
            return self.context.reject(ErrorReply(ErrorKind.BAD_REQUEST, str(exc)))
        self._launch(legs, request)
        self._busy_s += time.perf_counter() - started
        service.metrics.processing_seconds.observe(self._busy_s)
        return msg.last_chunk_response(tail)

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
                if exc.local:
                    return self.context.reject(_exhausted(exc))
                service.breakers.record(self._target, POD_DOWN if exc.pod_down else "bootstrap")
                return self._without_prefill(ErrorReply(ErrorKind.BOOTSTRAP, str(exc)))
        busy = service.launcher.in_flight_by_rank(self._target)
        try:
            legs = service.connector.legs(checked, self._target, engines, busy)
        except BodyError as exc:
            return self.context.reject(ErrorReply(ErrorKind.BAD_REQUEST, str(exc)))
        job = self._launch(legs, checked)
        self._busy_s += time.perf_counter() - started
        service.metrics.processing_seconds.observe(self._busy_s)
        if service.connector.sequential or legs.decode_body is None:
            # The body's answer waits for the prefill (Envoy is told to wait if it must); the
            # client's body, kept for it till then, stays counted (released at close).
            self._budget.keep(len(checked.raw))
            return self._deferred(job, self._released_after(self._after_prefill(job, checked)))
        return self._decode(legs.decode_body)

    def _launch(self, legs: Legs, request: ClientRequest) -> PrefillJob:
        """Launch the prefill leg; a concurrent connector's outcome is watched from here."""
        service = self.context.service
        excerpt = {}
        if service.settings.log_bodies:
            excerpt["body"] = request.raw[:BODY_LOG_BYTES].decode("utf-8", "replace")
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
        if not sequential:
            job.outcome.add_done_callback(self._prefill_done)
        return job

    def _decode(self, body: bytes) -> msg.Response:
        # With the request headers still held, the decode gets the id the prefill got.
        return msg.body_response(
            body,
            content_length=not self.context.single_message,
            request_id=self.context.held_request_id(),
        )

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

    async def _released_after(self, answer: Awaitable[msg.Response]) -> msg.Response:
        """The answer; the body bytes this request held are released once it is built."""
        try:
            return await answer
        finally:
            self._budget.release()

    async def _after_prefill(self, job: PrefillJob, request: ClientRequest) -> msg.Response:
        """Sequential connectors: the decode leg once the prefill has answered."""
        outcome = await asyncio.shield(job.outcome)
        connector = self.context.service.connector
        if outcome.ok and outcome.answer is not None:
            try:
                body = connector.decode_body(
                    request, outcome.answer, self._target, self.context.service.admits
                )
            except NoKvParams as exc:
                return self._alone(f"unusable prefill answer: {exc}")
            except AnswerError as exc:
                # The pod's answer is refused: the decode serves the request alone (NIXL's
                # failure rule), counted apart from an unusable or failed prefill.
                fail(self.context.span, str(exc))
                return self._alone(f"prefill answer refused: {exc}", REFUSED_ANSWER)
            return self._decode(body)  # counted once the decode answers (response_headers)
        reply = prefill_error(outcome)
        if connector.on_failure(outcome.status) is OnFailure.PASS_THROUGH:
            self.context.finish(reply.kind.value)
            return msg.passed_through(
                outcome.status or 502, outcome.answer or b"", outcome.content_type
            )
        return self._alone(reply.message)

    def _alone(self, reason: str, outcome: str = "decode_only") -> msg.Response:
        return DecodeOnly(self.context, outcome, reason).served_alone()

    def _without_prefill(self, reply: ErrorReply) -> Answer:
        """No prefill can serve this request: reject it, or let the decode do it alone."""
        if self.context.service.settings.on_bootstrap_error is BootstrapPolicy.REJECT:
            return self.context.reject(reply)
        return self._alone(reply.message)

    def _prefill_done(self, outcome: asyncio.Future[PrefillOutcome]) -> None:
        """Count a failure (and abort the request at once if the decode has not answered);
        a success counts as `pd` once the decode has answered too."""
        result = outcome.result()
        if result.ok:
            if self._response_seen:
                self.context.finish("pd")
            return
        self.context.finish(prefill_error(result).kind.value)
        if not self._response_seen:
            self._abort(self._aborted(result, "before_response"))

    def response_headers(self, headers: pb.HttpHeaders) -> Answer:
        self._response_seen = True
        job = self._job
        if job is None and self._streamed is not None and not self.context.finished:
            # An answer to a streamed body whose end pdproc never released: Envoy's own (the
            # kv guard's buffer overflowed: 413) or the decode's, to a body it never got
            # whole. It goes to the client as it is; the request is counted here.
            status = msg.status_of(headers)
            self._budget.release()
            self.context.finish(ErrorKind.TOO_LARGE.value if status == "413" else UNFINISHED)
            return msg.CONTINUE_RESPONSE_HEADERS
        if job is None:
            return msg.CONTINUE_RESPONSE_HEADERS
        status = msg.status_of(headers)
        if status.startswith("5"):
            # A decode 5xx may be a stale engine id (the prefill pod restarted): re-query.
            self.context.service.engines.invalidate(job.target)
        if self.context.service.connector.sequential:
            # The prefill ended before the decode began.
            if job.outcome.done() and job.outcome.result().ok:
                self.context.finish("pd")
            return msg.CONTINUE_RESPONSE_HEADERS
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
            self.context.finish("pd")
            return msg.CONTINUE_RESPONSE_HEADERS
        return self._aborted(outcome, when)

    def _aborted(self, outcome: PrefillOutcome, when: str) -> msg.Response:
        """The one abort path: the decode is cancelled and the client gets the error."""
        self.context.service.metrics.aborts.labels(when).inc()
        fail(self.context.span, outcome.error or outcome.outcome)
        return msg.immediate(prefill_error(outcome))

    def close(self, *, abandoned: bool) -> None:
        job = self._job
        if abandoned and not self.context.finished:
            if job is not None and job.task is not None and not job.outcome.done():
                # The client left before the decode answered: Envoy resets the decode, so
                # nobody will use this prefill's KV. Cancelling it closes its connection,
                # which has vLLM and SGLang abort it and free its work and blocks
                # (docs/operations.md, "Clients that hang up").
                job.task.cancel()
                self.context.finish(CANCELLED)
            else:
                self.context.finish(ABANDONED)
        self._budget.release()
        self.context.close()


def _exhausted(exc: Exception) -> ErrorReply:
    """pdproc itself is out of resources: a 503 like any overload, not the pod's fault."""
    log.error("pdproc is out of resources: %s", exc)
    return ErrorReply(ErrorKind.OVERLOADED, "the gateway is out of resources; retry later")


def prefill_error(outcome: PrefillOutcome) -> ErrorReply:
    if outcome.outcome == EXHAUSTED:
        return ErrorReply(ErrorKind.OVERLOADED, "the gateway is out of resources; retry later")
    if outcome.outcome == "timeout":
        return ErrorReply(ErrorKind.PREFILL_TIMEOUT, f"prefill timed out: {outcome.error}")
    return ErrorReply(ErrorKind.PREFILL_FAILED, f"prefill failed: {outcome.error}")
