"""Per-request processors: one method per ext_proc phase, each returning its answer.

The service picks one processor per request when the request's headers arrive:

- `PassThrough` (a null object): not a P/D request; Envoy stops sending anything more.
- `Rejected`: refused at the door (bad prefill header, forbidden target, pod known down).
- `DecodeOnly`: a P/D path served by the decode alone (no prefill target, draining, or
  `--on-bootstrap-error decode-only`); its body is still checked.
- `ConcurrentPair` and `SequentialPair` (both `Disaggregated`): the P/D pair. Which one runs
  follows the connector's kind: the prefill beside the decode (Mooncake, SGLang), or before
  it (NIXL v2). Neither knows which connector it runs.

A processor gets what it uses handed in (`Deps`, its connector, its request's
`RequestContext`), so a test builds one without a server. Every request ends in exactly one
outcome, in its `Ledger`: recorded where it is decided, and settled by the stream's end
with what `close` returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry.trace import Span

from pdproc import extproc_messages as msg
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc.budget import BodyBytes, ByteBudget
from pdproc.config import BootstrapPolicy, Settings
from pdproc.connectors import (
    AnswerError,
    ClientRequest,
    Concurrent,
    Connector,
    EngineMap,
    Legs,
    NoKvParams,
    OnFailure,
    Sequential,
)
from pdproc.decode_choice import DecodePick
from pdproc.engine_maps import BootstrapError
from pdproc.errors import ErrorKind, ErrorReply
from pdproc.extproc_wire import Body
from pdproc.ledger import Ledger
from pdproc.metrics import Metrics
from pdproc.outcomes import Outcome, PrefillResult
from pdproc.pod_load import PodLoad
from pdproc.pod_verdict import Verdict
from pdproc.pool_choice import Refined
from pdproc.prefill import PrefillJob, PrefillLauncher, PrefillOutcome
from pdproc.request_body import BodyError, members, parse_body
from pdproc.streamed_body import TAIL, StreamedBody, parse_content_length
from pdproc.targets import HostPort
from pdproc.telemetry import (
    ATTR_CONNECTOR,
    ATTR_DECODE,
    ATTR_DECODE_MATCHED,
    ATTR_STREAMED,
    ATTR_TARGET,
    fail,
    trace_fields,
)

log = logging.getLogger(__name__)

BODY_LOG_BYTES = 4096
# Pool members a request's bootstrap query is tried on before it fails (or is served by the
# decode alone): a bound, so a pool whose bootstrap servers all fail costs a few queries.
BOOTSTRAP_TRIES = 3
_OVERLOADED = ErrorReply(
    ErrorKind.OVERLOADED, "too many request bytes in flight at this gateway; retry later"
)
_TRAILERS = ErrorReply(ErrorKind.BAD_REQUEST, "request trailers are not supported on P/D paths")


@dataclass(frozen=True, slots=True)
class Deferred:
    """An answer that comes later. Envoy gives up on it after its message_timeout, so if it
    is not ready `hold_after` seconds from now, `hold()` (a longer timeout, made then) is
    written first: the usual short wait costs no extra message."""

    later: Awaitable[msg.Answer]
    hold: Callable[[], msg.Answer]
    hold_after: float


# The stream's way to end its request unasked (an immediate response written now).
Abort = Callable[[msg.Answer], None]


def _nothing() -> None:
    pass


class EngineLookup(Protocol):
    """Engine maps of prefill pods (pdproc.engine_maps.EngineMaps)."""

    def prefetch(self, target: HostPort, span: Span | None = None) -> None: ...

    async def get(self, target: HostPort, span: Span | None = None) -> EngineMap: ...

    def invalidate(self, target: HostPort) -> None: ...


@dataclass(frozen=True, slots=True)
class Deps:
    """What processors use beyond their request, shared by all requests of a process."""

    settings: Settings
    metrics: Metrics
    budget: ByteBudget  # --max-inflight-bytes
    engines: EngineLookup
    launcher: PrefillLauncher  # tests hand in a stand-in of the same shape
    # What a pod's failed bootstrap query says about it (the circuit breakers' record).
    pod_failed: Callable[[HostPort, Verdict], None]
    # Whether the gateway admits an address as a KV source (NIXL's side channel).
    admits: Callable[[HostPort], bool]
    # Requests assigned to each pod before their prefill runs (counted as its load).
    load: PodLoad
    # Another usable pool member, none of those given, for a request whose pod's bootstrap
    # query failed before anything was sent to it; None when there is none.
    reroute: Callable[[Collection[HostPort]], HostPort | None]
    # The pool policy's second look at a request pdproc placed, once its body is known
    # (the header-time pick given): the member to use.
    refine: Callable[[ClientRequest, HostPort], Refined] | None = None
    # A pod's engine ids, each time a request gets them (the pool policy's news of restarts).
    engines_seen: Callable[[HostPort, EngineMap], None] | None = None
    # --decode-choice prefix: the decode a request pdproc placed goes to, once its body is
    # known (None: Envoy's choice).
    choose_decode: Callable[[ClientRequest], DecodePick | None] | None = None


class RequestContext:
    """What every processor of one request shares: who it is, its span, its ledger."""

    def __init__(
        self,
        headers: Mapping[str, str],
        path: str,
        span: Span | None,
        ledger: Ledger,
        *,
        single_message: bool,
        id_replaced: bool = False,
    ) -> None:
        self.headers = headers
        self.path = path
        self.span = span
        self.ledger = ledger
        self.single_message = single_message
        # pdproc's id for the request (pdproc.request_ids): the client's x-request-id, or one
        # pdproc minted in place of an unfit value (`id_replaced`).
        self.request_id = headers.get("x-request-id", "")
        self.id_replaced = id_replaced
        # The decode pdproc named (IP:PORT), carried by every body answer from then on.
        self.decode: str | None = None

    @property
    def finished(self) -> bool:
        return self.ledger.settled

    def finish(self, outcome: Outcome) -> None:
        """Record the request's outcome, unless it has one."""
        self.ledger.record(outcome)

    def held_request_id(self) -> str | None:
        """The id to set on the decode leg: pdproc's, when it replaced the client's and
        Envoy still holds the request headers (two-message mode)."""
        return self.request_id if self.id_replaced and not self.single_message else None

    def log_fields(self, **more: Any) -> dict[str, Any]:
        return {"request_id": self.request_id, "path": self.path, **trace_fields(self.span), **more}

    def reject(self, reply: ErrorReply) -> msg.Answer:
        """Answer the request in Envoy's place; the request ends here and is counted here."""
        self.finish(Outcome.of(reply.kind))
        fail(self.span, reply.message)
        log.warning(
            "request rejected: %s",
            reply.message,
            extra=self.log_fields(outcome=reply.kind.value, status=reply.status),
        )
        return msg.immediate(reply)

    def count_decode_only(self, outcome: Outcome, reason: str | None = None) -> None:
        """Record (and log, if it is a fallback) that the decode serves this request alone."""
        if reason is not None:
            log.warning(
                "decode-only fallback: %s", reason, extra=self.log_fields(outcome=outcome.value)
            )
        self.finish(outcome)

    def serve_decode_only(self, outcome: Outcome, reason: str | None = None) -> msg.Answer:
        """The client's own body goes on to the decode, marked as checked."""
        self.count_decode_only(outcome, reason)
        return msg.checked_request_body(self.held_request_id(), self.decode)

    def close(self) -> None:
        if self.span is not None:
            self.span.end()


class RequestProcessor(Protocol):
    context: RequestContext

    async def request_headers(self) -> msg.Answer | Deferred: ...

    async def request_body(self, body: Body) -> msg.Answer | Deferred: ...

    def request_trailers(self) -> msg.Answer | Deferred: ...

    def response_headers(self, headers: pb.HttpHeaders) -> msg.Answer | Deferred: ...

    def close(self, *, abandoned: bool) -> Outcome | None:
        """The stream ended (`abandoned`: before the decode's answer went to the client).
        Returns the outcome of a request that has none yet, unless one is still to come
        (a concurrent prefill still running once the decode has answered)."""


class PassThrough:
    """Not a P/D request: let everything through, and have Envoy send nothing more."""

    def __init__(self, context: RequestContext) -> None:
        self.context = context
        context.finish(Outcome.PASSTHROUGH)

    async def request_headers(self) -> msg.Answer | Deferred:
        return msg.PASS_THROUGH_HEADERS

    async def request_body(self, body: Body) -> msg.Answer | Deferred:
        return msg.CONTINUE_REQUEST_BODY

    def request_trailers(self) -> msg.Answer | Deferred:
        return msg.CONTINUE_REQUEST_TRAILERS

    def response_headers(self, headers: pb.HttpHeaders) -> msg.Answer | Deferred:
        return msg.CONTINUE_RESPONSE_HEADERS

    def close(self, *, abandoned: bool) -> Outcome | None:
        return Outcome.ABANDONED if abandoned else None


class Rejected(PassThrough):
    """Refused before its body was read (in single-message mode: when it arrives)."""

    def __init__(self, context: RequestContext, reply: ErrorReply) -> None:
        self.context = context
        self._reply = reply

    async def request_headers(self) -> msg.Answer | Deferred:
        return self.context.reject(self._reply)

    async def request_body(self, body: Body) -> msg.Answer | Deferred:
        return self.context.reject(self._reply)


def checked_body(context: RequestContext, body: Body, max_bytes: int) -> ClientRequest | ErrorReply:
    """The checks every P/D-path body passes before anything is done with it."""
    if not body.end_of_stream:
        # BUFFERED sends a body not marked as the request's end only when trailers follow it
        # (a body that outgrows the buffer gets Envoy's own 413). The rewritten body could
        # not end the request, so trailers are refused, as for a streamed body.
        return _TRAILERS
    raw = body.body
    if len(raw) > max_bytes:
        return ErrorReply(ErrorKind.TOO_LARGE, f"request body exceeds {max_bytes} bytes")
    try:
        return ClientRequest(context.path, raw, parse_body(raw), context.request_id)
    except BodyError as exc:
        return ErrorReply(ErrorKind.BAD_REQUEST, str(exc))


async def serve_checked(
    context: RequestContext,
    held: BodyBytes,
    max_bytes: int,
    body: Body,
    serve: Callable[[ClientRequest], Awaitable[msg.Answer | Deferred]],
) -> msg.Answer | Deferred:
    """A whole body, counted in `held` while it is checked and `serve`d (and after, by
    whoever `serve` hands the bytes on to); the client's 503 when the budget is full, its
    4xx when the body fails the checks."""
    try:
        if not held.take(len(body)):
            return context.reject(_OVERLOADED)
        checked = checked_body(context, body, max_bytes)
        if isinstance(checked, ErrorReply):
            return context.reject(checked)
        return await serve(checked)
    finally:
        held.release()


class DecodeOnly(PassThrough):
    """A P/D path the decode serves alone; the body is still checked (no client params)."""

    def __init__(
        self, context: RequestContext, deps: Deps, outcome: Outcome, reason: str | None = None
    ) -> None:
        self.context = context
        self._deps = deps
        self._outcome = outcome
        self._reason = reason

    async def request_headers(self) -> msg.Answer | Deferred:
        return msg.CHECK_BODY_ONLY_HEADERS

    async def request_body(self, body: Body) -> msg.Answer | Deferred:
        deps = self._deps
        held = deps.budget.body()
        return await serve_checked(
            self.context, held, deps.settings.max_body_bytes, body, self._serve
        )

    async def _serve(self, request: ClientRequest) -> msg.Answer | Deferred:
        return self.context.serve_decode_only(self._outcome, self._reason)


class Disaggregated:
    """What both P/D pairs share: the prefill launched by pdproc, the decode carried by
    Envoy, and one path from a known body to launched legs (`_pair`)."""

    def __init__(
        self,
        context: RequestContext,
        deps: Deps,
        connector: Connector,
        target: HostPort,
        *,
        min_prompt: int = 0,
        from_pool: bool = False,
    ) -> None:
        self.context = context
        self._deps = deps
        self._uses_engines = connector.uses_engines
        self._target = target
        self._claim = deps.load.claim(target)
        self._from_pool = from_pool  # pdproc's choice: another member may stand in
        self._choice_facts: Mapping[str, int] = {}
        self._min_prompt = min_prompt
        self._job: PrefillJob | None = None
        self._decode_pick: DecodePick | None = None
        self._response_seen = False
        self._body_seen = False
        self._busy_s = 0.0
        # The body's bytes against --max-inflight-bytes (pdproc.budget): a buffered body's
        # while it is processed, a streamed body's chunks as they arrive; then held on by
        # the prefill leg until it is sent, or a sequential connector's decode leg until it
        # is built.
        self._budget = deps.budget.body()
        self._let_go_after_prefill: Callable[[], None] = _nothing
        if context.span is not None:
            context.span.set_attribute(ATTR_TARGET, str(target))
            context.span.set_attribute(ATTR_CONNECTOR, connector.name)

    async def request_headers(self) -> msg.Answer | Deferred:
        started = time.perf_counter()
        if self._uses_engines:
            # Overlap a cache miss with Envoy sending the body.
            self._deps.engines.prefetch(self._target, self.context.span)
        answer = self._headers_answer()
        self._busy_s += time.perf_counter() - started
        return answer

    def _headers_answer(self) -> msg.Answer:
        return msg.CONTINUE_REQUEST_HEADERS

    async def request_body(self, body: Body) -> msg.Answer | Deferred:
        self._body_seen = True
        max_bytes = self._deps.settings.max_body_bytes
        return await serve_checked(self.context, self._budget, max_bytes, body, self._serve)

    async def _serve(self, request: ClientRequest) -> msg.Answer | Deferred:
        if len(request.raw) < self._min_prompt:
            # Too short for P/D to pay: the decode does it all (--pd-min-prompt).
            return self.context.serve_decode_only(Outcome.SHORT_PROMPT)
        return await self._pair(request, None)

    def request_trailers(self) -> msg.Answer | Deferred:
        if self._body_seen or self.context.finished:
            return msg.CONTINUE_REQUEST_TRAILERS  # a body with trailers was refused already
        # Trailers with no body before them: refused like trailers after a body, rather
        # than reaching the decode unchecked and uncounted.
        return self.context.reject(_TRAILERS)

    async def _pair(
        self, request: ClientRequest, streamed: StreamedBody | None
    ) -> msg.Answer | Deferred:
        """The body is known: the engine map (if the connector needs one), the legs, the
        prefill launched, and the body's answer. `streamed`: the body went on to the decode
        as it arrived, all but its tail."""
        started = time.perf_counter()
        if self._names_decode:
            pick = self._choose_decode(request)
            if pick is not None and pick.skip_pd:
                self._busy_s += time.perf_counter() - started
                return self.context.serve_decode_only(Outcome.DECODE_CACHED)
        if self._from_pool and self._deps.refine is not None:
            self._refine(request, self._deps.refine)
        engines: EngineMap | None = None
        if self._uses_engines:
            found = await self._engine_map()
            if isinstance(found, BootstrapError):
                return self._no_engines(found, request, streamed)
            engines = found
            if self._deps.engines_seen is not None:
                self._deps.engines_seen(self._target, engines)
        in_flight_by_rank = self._deps.launcher.in_flight_by_rank(self._target)
        try:
            answer = self._launch_legs(request, engines, in_flight_by_rank, streamed)
        except BodyError as exc:
            return self.context.reject(ErrorReply(ErrorKind.BAD_REQUEST, str(exc)))
        self._busy_s += time.perf_counter() - started
        self._deps.metrics.processing_seconds.observe(self._busy_s)
        return answer

    @property
    def _names_decode(self) -> bool:
        """pdproc names this request's decode (a pool-mode request, --decode-choice prefix)."""
        return self._from_pool and self._deps.choose_decode is not None

    def _choose_decode(self, request: ClientRequest) -> DecodePick | None:
        assert self._deps.choose_decode is not None
        pick = self._decode_pick = self._deps.choose_decode(request)
        if pick is None:
            return None
        self.context.decode = str(pick.pod)
        span = self.context.span
        if span is not None:
            span.set_attribute(ATTR_DECODE, self.context.decode)
            span.set_attribute(ATTR_DECODE_MATCHED, pick.matched_blocks)
        if pick.skip_pd:
            log.debug(
                "the decode holds most of the prompt: it serves the request alone",
                extra=self.context.log_fields(
                    decode=self.context.decode,
                    matched_blocks=pick.matched_blocks,
                    prompt_blocks=pick.prompt_blocks,
                ),
            )
        return pick

    def _launch_legs(
        self,
        request: ClientRequest,
        engines: EngineMap | None,
        in_flight_by_rank: Mapping[int, int],
        streamed: StreamedBody | None,
    ) -> msg.Answer | Deferred:
        """Build the legs (BodyError when the body cannot be carried), launch the prefill,
        and return the body's answer."""
        raise NotImplementedError

    async def _engine_map(self) -> EngineMap | BootstrapError:
        """The target's engine map. Nothing was sent to a pod yet, so when its bootstrap
        query fails a request pdproc placed moves to another usable member (at most
        BOOTSTRAP_TRIES pods in all); the last failure when none could serve."""
        tried: list[HostPort] = []
        while True:
            try:
                return await self._deps.engines.get(self._target, self.context.span)
            except BootstrapError as exc:
                if exc.verdict is Verdict.NOT_THE_POD:
                    return exc
                self._deps.pod_failed(self._target, exc.verdict)
                tried.append(self._target)
                other = self._other_member(tried)
                if other is None:
                    return exc
                self._move_to(other, exc)

    def _refine(
        self, request: ClientRequest, refine: Callable[[ClientRequest, HostPort], Refined]
    ) -> None:
        """The pool policy may move the request to another member (its own claim is not
        counted while the policy weighs the loads)."""
        self._claim.release()
        refined = refine(request, self._target)
        target, self._choice_facts = refined.target, refined.facts
        self._claim = self._deps.load.claim(target)
        if target != self._target:
            self._target = target
            if self.context.span is not None:
                self.context.span.set_attribute(ATTR_TARGET, str(target))

    def _other_member(self, tried: Collection[HostPort]) -> HostPort | None:
        if not self._from_pool or len(tried) >= BOOTSTRAP_TRIES:
            return None
        return self._deps.reroute(tried)

    def _move_to(self, target: HostPort, exc: BootstrapError) -> None:
        log.warning(
            "bootstrap query failed, trying another pool member: %s",
            exc,
            extra=self.context.log_fields(prefill_target=str(self._target), next=str(target)),
        )
        self._deps.metrics.reroutes.inc()
        self._claim.release()
        self._target = target
        self._claim = self._deps.load.claim(target)
        if self.context.span is not None:
            self.context.span.set_attribute(ATTR_TARGET, str(target))

    def _no_engines(
        self, exc: BootstrapError, request: ClientRequest, streamed: StreamedBody | None
    ) -> msg.Answer:
        """No engine map for any pod tried: reject the request, or let the decode do it
        alone."""
        if exc.verdict is Verdict.NOT_THE_POD:
            return self.context.reject(_exhausted(exc))
        reply = ErrorReply(ErrorKind.BOOTSTRAP, str(exc))
        if self._deps.settings.on_bootstrap_error is BootstrapPolicy.REJECT:
            return self.context.reject(reply)
        if streamed is None:
            return self.context.serve_decode_only(Outcome.DECODE_ONLY, reply.message)
        self.context.count_decode_only(Outcome.DECODE_ONLY, reply.message)
        return msg.last_chunk_response(
            streamed.tail(request.raw, b"", empty_object=not request.parsed)
        )

    def _launch(self, legs: Legs, request: ClientRequest, *, keep_answer: bool) -> PrefillJob:
        excerpt: dict[str, Any] = dict(self._choice_facts)
        if self._deps.settings.log_bodies:
            excerpt["body"] = request.raw[:BODY_LOG_BYTES].decode("utf-8", "replace")
        job = self._job = self._deps.launcher.launch(
            target=self._target,
            legs=legs,
            path=self.context.path,
            client_headers=self.context.headers,
            parent_span=self.context.span,
            log_fields=excerpt,
            keep_answer=keep_answer,
        )
        self._claim.release()  # the launcher counts it now
        if self.context.span is not None:
            for key, value in legs.facts.items():
                self.context.span.set_attribute(f"pdproc.{key}", value)
        return job

    def _decode(self, body: bytes) -> msg.Answer:
        # With the request headers still held, the decode gets the id the prefill got.
        return msg.body_response(
            body,
            content_length=not self.context.single_message,
            request_id=self.context.held_request_id(),
            decode=self.context.decode,
        )

    def _deferred(self, job: PrefillJob, later: Awaitable[msg.Answer]) -> Deferred:
        """An answer that waits for the prefill. The override asking Envoy to wait is sized
        for the rest of the prefill (Envoy honours only the first per message, capped at
        the filter's max_message_timeout), and only sent when the wait nears Envoy's
        message_timeout."""
        settings = self._deps.settings
        timeout_s = self._deps.launcher.timeout_s

        def hold() -> msg.Answer:
            remaining = timeout_s - (time.perf_counter() - job.started)
            return msg.hold(min(max(remaining, 0.0) + 1.0, settings.envoy_max_message_timeout))

        # Leave the override time to reach Envoy before its own timer fires.
        timeout = settings.envoy_message_timeout
        return Deferred(later, hold, hold_after=max(timeout - 2.0, timeout / 2))

    def response_headers(self, headers: pb.HttpHeaders) -> msg.Answer | Deferred:
        self._response_seen = True
        job = self._job
        if job is None:
            return self._answered_unlaunched(headers)
        status = msg.status_of(headers)
        if status.startswith("5"):
            # A decode 5xx may be a stale engine id (the prefill pod restarted): re-query.
            self._deps.engines.invalidate(job.target)
        return self._answered(job, status)

    def _answered_unlaunched(self, headers: pb.HttpHeaders) -> msg.Answer | Deferred:
        """The decode answered a request whose prefill was never launched."""
        return msg.CONTINUE_RESPONSE_HEADERS

    def _answered(self, job: PrefillJob, status: str) -> msg.Answer | Deferred:
        """The decode answered with `status` (its response headers wait for this)."""
        raise NotImplementedError

    def close(self, *, abandoned: bool) -> Outcome | None:
        self._budget.release()
        self._claim.release()
        if self._decode_pick is not None:
            self._decode_pick.claim.release()
        self._let_go_after_prefill()
        if not abandoned or self.context.finished:
            return None
        job = self._job
        if job is not None and job.task is not None and not job.outcome.done():
            # The client left before the decode answered: Envoy resets the decode, so
            # nobody will use this prefill's KV. Cancelling it closes its connection,
            # which has vLLM and SGLang abort it and free its work and blocks
            # (docs/operations.md, "Clients that hang up").
            job.task.cancel()
            return Outcome.CANCELLED
        return Outcome.ABANDONED


class SequentialPair(Disaggregated):
    """The prefill first; the decode leg is built from its answer (NIXL v2)."""

    def __init__(
        self,
        context: RequestContext,
        deps: Deps,
        connector: Sequential,
        target: HostPort,
        *,
        min_prompt: int = 0,
        from_pool: bool = False,
    ) -> None:
        super().__init__(
            context, deps, connector, target, min_prompt=min_prompt, from_pool=from_pool
        )
        self._connector = connector

    def _launch_legs(
        self,
        request: ClientRequest,
        engines: EngineMap | None,
        in_flight_by_rank: Mapping[int, int],
        streamed: StreamedBody | None,
    ) -> msg.Answer | Deferred:
        legs = self._connector.legs(request, self._target, engines, in_flight_by_rank)
        job = self._launch(legs, request, keep_answer=True)
        # The body's answer waits for the prefill (Envoy is told to wait if it must); the
        # client's body, kept for it till then, stays counted (and is let go at close).
        self._let_go_after_prefill = self._budget.share()
        return self._deferred(job, self._released_after_prefill(job, request))

    async def _released_after_prefill(self, job: PrefillJob, request: ClientRequest) -> msg.Answer:
        """The decode leg; the body bytes this request held are released once it is built.
        The inner coroutine is made here, not by the caller, so an answer never awaited (its
        stream ended first) leaves no coroutine behind unawaited."""
        try:
            return await self._after_prefill(job, request)
        finally:
            self._let_go_after_prefill()

    async def _after_prefill(self, job: PrefillJob, request: ClientRequest) -> msg.Answer:
        """The decode leg once the prefill has answered."""
        outcome = await asyncio.shield(job.outcome)
        if outcome.ok and outcome.answer is not None:
            try:
                body = self._connector.decode_body(
                    request, outcome.answer, self._target, self._deps.admits
                )
            except NoKvParams as exc:
                return self.context.serve_decode_only(
                    Outcome.DECODE_ONLY, f"unusable prefill answer: {exc}"
                )
            except AnswerError as exc:
                # The pod's answer is refused: the decode serves the request alone (NIXL's
                # failure rule), counted apart from an unusable or failed prefill.
                fail(self.context.span, str(exc))
                return self.context.serve_decode_only(
                    Outcome.PREFILL_ANSWER_REFUSED, f"prefill answer refused: {exc}"
                )
            return self._decode(body)  # counted once the decode answers (response_headers)
        reply = prefill_error(outcome)
        if self._connector.on_failure(outcome.status) is OnFailure.PASS_THROUGH:
            self.context.finish(Outcome.of(reply.kind))
            return msg.passed_through(
                outcome.status or 502, outcome.answer or b"", outcome.content_type
            )
        return self.context.serve_decode_only(Outcome.DECODE_ONLY, reply.message)

    def _answered(self, job: PrefillJob, status: str) -> msg.Answer | Deferred:
        # The prefill ended before the decode began.
        if job.outcome.done() and job.outcome.result().ok:
            self.context.finish(Outcome.PD)
        return msg.CONTINUE_RESPONSE_HEADERS


class ConcurrentPair(Disaggregated):
    """The prefill beside the decode (Mooncake, SGLang): both legs are built before the
    body's answer, a large body may stream on to the decode as it arrives, and the decode's
    response headers wait for the prefill's outcome. A failed prefill ends the request."""

    def __init__(
        self,
        context: RequestContext,
        deps: Deps,
        connector: Concurrent,
        target: HostPort,
        abort: Abort,
        *,
        min_prompt: int = 0,
        from_pool: bool = False,
    ) -> None:
        super().__init__(
            context, deps, connector, target, min_prompt=min_prompt, from_pool=from_pool
        )
        self._connector = connector
        self._abort = abort
        self._streamed: StreamedBody | None = None

    def _headers_answer(self) -> msg.Answer:
        length = self._streamable_length()
        return msg.CONTINUE_REQUEST_HEADERS if length is None else self._stream(length)

    def _streamable_length(self) -> int | None:
        """The body's length when it is to be streamed (pdproc.streamed_body), else None."""
        settings = self._deps.settings
        threshold = settings.stream_body_bytes
        if not threshold or self.context.single_message:
            return None  # single-message mode has no headers answer to switch modes in
        if self._names_decode:
            # Envoy picks the upstream host once the headers go on, before a streamed body
            # is known: a decode named from the body must have it buffered.
            return None
        length = parse_content_length(self.context.headers.get("content-length"))
        if length is None or length < max(threshold, TAIL + 1, self._min_prompt):
            return None
        if length > settings.max_body_bytes:
            return None  # buffered, it gets Envoy's 413 or pdproc's
        return length

    def _stream(self, length: int) -> msg.Answer:
        """Have Envoy stream the body past pdproc; its bytes count against the in-flight
        budget as they arrive, until its end. The announced length reserves nothing."""
        if self._deps.budget.full:
            return self.context.reject(_OVERLOADED)
        self._streamed = StreamedBody(length)
        if self.context.span is not None:
            self.context.span.set_attribute(ATTR_STREAMED, True)
        self._deps.metrics.streamed_bodies.inc()
        return msg.STREAMED_HEADERS

    async def request_body(self, body: Body) -> msg.Answer | Deferred:
        if self._streamed is None:
            return await super().request_body(body)
        return await self._stream_chunk(body, self._streamed)

    async def _stream_chunk(self, body: Body, streamed: StreamedBody) -> msg.Answer | Deferred:
        """A chunk of a streamed body: on at once, except the held-back tail."""
        if not self._budget.take(len(body)):
            return self._stream_refused(_OVERLOADED)
        try:
            data = streamed.feed(body.view, body.end_of_stream)
        except BodyError as exc:
            return self._stream_refused(ErrorReply(ErrorKind.BAD_REQUEST, str(exc)))
        if not body.end_of_stream:
            return msg.chunk_response(data)
        try:
            return await self._stream_end(streamed)
        finally:
            self._budget.release()

    async def _stream_end(self, streamed: StreamedBody) -> msg.Answer | Deferred:
        """The whole body is in: check it, then pair it. A refusal here cuts the decode off
        mid-body."""
        raw = streamed.whole()
        try:
            request = ClientRequest(
                self.context.path, raw, parse_body(raw), self.context.request_id
            )
        except BodyError as exc:
            return self.context.reject(ErrorReply(ErrorKind.BAD_REQUEST, str(exc)))
        return await self._pair(request, streamed)

    def _stream_refused(self, reply: ErrorReply) -> msg.Answer:
        """A streamed body refused before its end: its bytes leave the budget now."""
        self._budget.release()
        return self.context.reject(reply)

    def request_trailers(self) -> msg.Answer | Deferred:
        if self._streamed is not None and not self.context.finished:
            # Only a chunk marked as the body's last can carry its rewritten end.
            return self._stream_refused(_TRAILERS)
        return super().request_trailers()

    def _launch_legs(
        self,
        request: ClientRequest,
        engines: EngineMap | None,
        in_flight_by_rank: Mapping[int, int],
        streamed: StreamedBody | None,
    ) -> msg.Answer | Deferred:
        plan = self._connector.plan(self._target, engines, in_flight_by_rank)
        if streamed is None:
            decode_body = self._connector.decode_leg(request, plan)
            legs = self._connector.prefill_leg(request, plan, decode_body)
            answer = self._decode(decode_body)
        else:
            legs = self._connector.prefill_leg(request, plan, None)
            tail = streamed.tail(
                request.raw, members(plan.decode_fields), empty_object=not request.parsed
            )
            answer = msg.last_chunk_response(tail)
        job = self._launch(legs, request, keep_answer=False)
        # The client's body stays counted until the prefill leg (views of it) is written to
        # the pod: a pod slow to read must not let pdproc hold more than the budget says.
        self._budget.until(job.body_sent)
        job.outcome.add_done_callback(self._prefill_done)
        return answer

    def _prefill_done(self, outcome: asyncio.Future[PrefillOutcome]) -> None:
        """Count a failure (and abort the request at once if the decode has not answered);
        a success counts as `pd` once the decode has answered too."""
        result = outcome.result()
        if result.ok:
            if self._response_seen:
                self.context.finish(Outcome.PD)
            return
        if self.context.finished:
            return  # the request ended first (the client left, and pdproc cancelled this)
        if self._response_seen:
            # The decode answered already: its error (or its held answer, aborted from
            # `_held`) is what the client sees; the request is counted as the prefill's.
            self.context.finish(Outcome.of(prefill_error(result).kind))
        else:
            self._abort(self._aborted(result, "before_response"))

    def _answered_unlaunched(self, headers: pb.HttpHeaders) -> msg.Answer | Deferred:
        if self._streamed is not None and not self.context.finished:
            # An answer to a streamed body whose end pdproc never released: Envoy's own (the
            # kv guard's buffer overflowed: 413) or the decode's, to a body it never got
            # whole. It goes to the client as it is; the request is counted here.
            self._budget.release()
            too_large = msg.status_of(headers) == "413"
            self.context.finish(Outcome.TOO_LARGE if too_large else Outcome.UNFINISHED_BODY)
        return msg.CONTINUE_RESPONSE_HEADERS

    def _answered(self, job: PrefillJob, status: str) -> msg.Answer | Deferred:
        if job.outcome.done():
            return self._settled(job.outcome.result(), "before_response")
        if not status.startswith("2"):
            # The decode failed on its own: the client sees its error; the prefill carries on.
            return msg.CONTINUE_RESPONSE_HEADERS
        return self._deferred(job, self._held(job))

    async def _held(self, job: PrefillJob) -> msg.Answer:
        started = time.perf_counter()
        outcome = await asyncio.shield(job.outcome)
        self._deps.metrics.hold_seconds.observe(time.perf_counter() - started)
        return self._settled(outcome, "held")

    def _settled(self, outcome: PrefillOutcome, when: str) -> msg.Answer:
        if outcome.ok:
            self.context.finish(Outcome.PD)
            return msg.CONTINUE_RESPONSE_HEADERS
        return self._aborted(outcome, when)

    def _aborted(self, outcome: PrefillOutcome, when: str) -> msg.Answer:
        """The one abort path: the decode is cancelled and the client gets the error."""
        reply = prefill_error(outcome)
        self.context.finish(Outcome.of(reply.kind))
        self._deps.metrics.aborts.labels(when).inc()
        fail(self.context.span, outcome.error or outcome.outcome.value)
        return msg.immediate(reply)


def _exhausted(exc: Exception) -> ErrorReply:
    """pdproc itself is out of resources: a 503 like any overload, not the pod's fault."""
    log.error("pdproc is out of resources: %s", exc)
    return ErrorReply(ErrorKind.OVERLOADED, "the gateway is out of resources; retry later")


def prefill_error(outcome: PrefillOutcome) -> ErrorReply:
    if outcome.outcome is PrefillResult.EXHAUSTED:
        return ErrorReply(ErrorKind.OVERLOADED, "the gateway is out of resources; retry later")
    if outcome.outcome is PrefillResult.TIMEOUT:
        return ErrorReply(ErrorKind.PREFILL_TIMEOUT, f"prefill timed out: {outcome.error}")
    return ErrorReply(ErrorKind.PREFILL_FAILED, f"prefill failed: {outcome.error}")
