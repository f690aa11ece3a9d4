"""The ext_proc stream: one gRPC stream per HTTP request, turned into a Mooncake P/D pair.

Data flows one way: request headers pick the prefill target, the buffered body is rewritten
for the decode pod and the prefill is launched, and the decode's response headers are held
until the prefill's outcome is known, so a failed prefill becomes a fast, clean error
instead of a decode that waits minutes for KV that never comes.

Envoy rules this code keeps (DESIGN.md §3): every message gets exactly one answer, in order;
header values go in `raw_value`; a body mutation sets `content-length`; the handler returns
as soon as it reads EOF; an unsolicited ImmediateResponse may be written at any time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct
from opentelemetry.trace import Span

from pdproc import mooncake
from pdproc.bootstrap import EngineMaps
from pdproc.breaker import POD_DOWN, CircuitBreakers
from pdproc.config import BootstrapPolicy, Settings
from pdproc.discovery import DnsPool
from pdproc.metrics import Metrics
from pdproc.openai import ErrorKind, ErrorReply
from pdproc.prefill import PrefillJob, PrefillLauncher, PrefillOutcome
from pdproc.targets import PREFILL_HEADER, HostPort, TargetError, target_from_header
from pdproc.telemetry import (
    ATTR_ENGINE_ID,
    ATTR_OUTCOME,
    ATTR_RANK,
    ATTR_TARGET,
    ATTR_TRANSFER_ID,
    Tracing,
    fail,
)

log = logging.getLogger(__name__)


class _CheckOnly:
    """Admission verdict: a P/D-path request the decode serves alone, body still checked."""


_CHECK_ONLY = _CheckOnly()

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_STRIP_PREFILL_HEADER = pb.HeaderMutation(remove_headers=[PREFILL_HEADER])

# Answers that never change, built once.
_CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=_STRIP_PREFILL_HEADER)
    )
)
# Not ours: stop buffering the body and skip the response phase (needs allow_mode_override;
# body modes in an override are absolute, so unset ones mean NONE, which is what we want).
_PASSTHROUGH = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=_STRIP_PREFILL_HEADER)
    ),
    mode_override=ProcessingMode(
        request_body_mode=ProcessingMode.NONE, response_header_mode=ProcessingMode.SKIP
    ),
)
_CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
# Body answers for a body pdproc has checked carry this mark, so a rule after ext_proc can
# refuse client-chosen kv_transfer_params on requests pdproc never saw (it failed open).
METADATA_CHECKED_KEY = "body_checked"
_CHECKED = Struct()
_CHECKED.update({"pdproc": {METADATA_CHECKED_KEY: True}})
_CHECKED_REQUEST_BODY = pb.ProcessingResponse(
    request_body=pb.BodyResponse(), dynamic_metadata=_CHECKED
)
# A P/D-path request pdproc does not disaggregate still has its body checked, but needs no
# response phase.
_CHECK_BODY_ONLY = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=_STRIP_PREFILL_HEADER)
    ),
    mode_override=ProcessingMode(
        request_body_mode=ProcessingMode.BUFFERED, response_header_mode=ProcessingMode.SKIP
    ),
)
_CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
_CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def immediate(reply: ErrorReply) -> pb.ProcessingResponse:
    body = reply.body()
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=reply.status),
            headers=pb.HeaderMutation(
                set_headers=[
                    _header("content-type", b"application/json"),
                    _header("x-pdproc-error", reply.kind.value.encode()),
                ]
            ),
            body=body,
            details=f"pdproc_{reply.kind.value}",
        )
    )


def _header(key: str, value: bytes) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value), append_action=_OVERWRITE)


# Single-message mode: what Envoy sends as request_attributes instead of a headers message
# (`pdproc envoy-config --single-message` lists exactly these), and the metadata namespace
# where a header_to_metadata filter puts the endpoint picker's prefill header.
ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
ATTRIBUTE_HEADERS = ("authorization", "traceparent", "tracestate", "baggage")
REQUEST_ATTRIBUTES = (
    "request.path",
    "request.method",
    "request.id",
    *(f"request.headers['{name}']" for name in ATTRIBUTE_HEADERS),
)
METADATA_NAMESPACE = "pdproc"
METADATA_PREFILL_KEY = "prefiller"


def headers_from_attributes(request: pb.ProcessingRequest) -> dict[str, str] | None:
    """The headers pdproc needs, rebuilt from the attributes and metadata Envoy sent with
    the body message; None when there are none (the filter is in two-message mode)."""
    attributes = request.attributes.get(ATTRIBUTES_KEY)
    if attributes is None or "request.path" not in attributes.fields:
        return None
    fields = attributes.fields
    headers = {":path": fields["request.path"].string_value}
    if "request.method" in fields:
        headers[":method"] = fields["request.method"].string_value
    if "request.id" in fields:
        headers["x-request-id"] = fields["request.id"].string_value
    for name, expression in zip(ATTRIBUTE_HEADERS, REQUEST_ATTRIBUTES[3:], strict=True):
        if expression in fields:
            headers[name] = fields[expression].string_value
    metadata = request.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
    if metadata is not None and METADATA_PREFILL_KEY in metadata.fields:
        headers[PREFILL_HEADER] = metadata.fields[METADATA_PREFILL_KEY].string_value
    return headers


def header_dict(headers: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's header list as a dict; repeated names are joined with a comma (RFC 9110)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        value = h.raw_value.decode("latin-1") if h.raw_value else h.value
        out[h.key] = f"{out[h.key]},{value}" if h.key in out else value
    return out


class Processor:
    """What all streams share: settings, the engine-id cache, the prefill launcher, metrics."""

    def __init__(
        self,
        settings: Settings,
        engines: EngineMaps,
        launcher: PrefillLauncher,
        breakers: CircuitBreakers,
        metrics: Metrics,
        tracing: Tracing | None = None,
        dns_pool: DnsPool | None = None,
    ) -> None:
        self.settings = settings
        self.dns_pool = dns_pool
        self.tracing = tracing or Tracing(None)
        self.engines = engines
        self.launcher = launcher
        self.breakers = breakers
        self.metrics = metrics
        self._static_pool = frozenset(settings.prefill_pool)
        self.draining = False  # shutting down: no new prefills, requests pass through
        self._outcome_counters: dict[tuple[str, str], Any] = {}

    def count(self, path: str, outcome: str) -> None:
        key = (path if path in self.settings.pd_paths else "other", outcome)
        counter = self._outcome_counters.get(key)
        if counter is None:
            counter = self._outcome_counters[key] = self.metrics.requests.labels(*key)
        counter.inc()

    def pool(self) -> tuple[HostPort, ...]:
        """Operator-given prefill pods: the static pool plus what DNS currently resolves to."""
        if self.dns_pool is None:
            return self.settings.prefill_pool
        return self.settings.prefill_pool + self.dns_pool.members

    def is_pool_member(self, target: HostPort) -> bool:
        return target in self._static_pool or (
            self.dns_pool is not None and target in self.dns_pool.members
        )

    def pick_pool_member(self, pool: tuple[HostPort, ...]) -> HostPort | None:
        """The pool member with the fewest prefills in flight whose breaker lets it be used."""
        members = sorted(pool, key=self.launcher.in_flight)
        return next((m for m in members if self.breakers.allow(m)), None)

    def on_prefill_outcome(self, job: PrefillJob, outcome: PrefillOutcome) -> None:
        # A P/D request is counted once, when its prefill's outcome decides how it ended.
        self.count(job.path, "pd" if outcome.ok else _prefill_error(outcome).kind.value)
        self.breakers.record(job.target, outcome.outcome)
        if not outcome.ok:
            # The pod may have restarted with new engine ids: ask again next time.
            self.engines.invalidate(job.target)


class ExtProcService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, processor: Processor) -> None:
        self._processor = processor

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> None:
        stream = RequestStream(self._processor, context)
        gauge = self._processor.metrics.streams_active
        gauge.inc()
        try:
            await stream.run()
        finally:
            gauge.dec()
            stream.close()


class RequestStream:
    """Per-request state. Envoy's messages arrive in order; our answers go out in order."""

    def __init__(
        self,
        processor: Processor,
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> None:
        self._p = processor
        self._context = context
        self._write_lock = asyncio.Lock()
        self._headers: dict[str, str] | None = None
        self._path = ""
        self._target: HostPort | None = None
        self._body_done = False
        self._job: PrefillJob | None = None
        self._response_seen = False
        self._finished = False  # an ImmediateResponse went out: Envoy is closing the stream
        self._hold: asyncio.Task[None] | None = None
        self._abort: asyncio.Task[bool] | None = None
        self._busy_s = 0.0
        self._unavailable: ErrorReply | None = None
        self._span: Span | None = None
        self._single_message = False
        self._check_only = False  # P/D path, no prefill: only the body is checked

    async def run(self) -> None:
        while True:
            message = await self._context.read()
            if message is grpc.aio.EOF:
                return  # Envoy resets the stream right after: leave now (DESIGN §3)
            try:
                await self._dispatch(message)
            except Exception:
                # A bug must not turn into a gRPC error (a bare 500, or with fail-open a
                # request silently not disaggregated): answer it, log it, count it.
                log.exception("ext_proc message handling failed")
                await self._reject(ErrorReply(ErrorKind.INTERNAL, "internal error in pdproc"))

    def close(self) -> None:
        if self._hold is not None and not self._hold.done():
            self._hold.cancel()  # the client left; the prefill itself carries on
        if self._span is not None:
            self._span.end()

    def _trace_outcome(self, outcome: str) -> None:
        if self._span is not None:
            self._span.set_attribute(ATTR_OUTCOME, outcome)

    async def _dispatch(self, message: pb.ProcessingRequest) -> None:
        if self._finished:
            return  # we already answered the whole request; nothing more is expected
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            await self._on_request_headers(message.request_headers)
        elif kind == "request_body":
            await self._on_request_body(message)
        elif kind == "response_headers":
            await self._on_response_headers(message.response_headers)
        elif kind == "response_body":
            await self._write(_CONTINUE_RESPONSE_BODY)
        elif kind == "request_trailers":
            await self._write(_CONTINUE_REQUEST_TRAILERS)
        elif kind == "response_trailers":
            await self._write(_CONTINUE_RESPONSE_TRAILERS)
        else:
            log.warning("unexpected ext_proc message %r ignored", kind)

    async def _write(self, response: pb.ProcessingResponse) -> bool:
        async with self._write_lock:
            if self._finished:
                return False
            if response.HasField("immediate_response"):
                self._finished = True
            try:
                await self._context.write(response)
            except (grpc.aio.AbortError, grpc.aio.UsageError, RuntimeError) as exc:
                # Envoy already closed the stream (client gone): nothing can be answered.
                log.debug("ext_proc write after stream end: %r", exc)
                return False
            return True

    async def _reject(self, reply: ErrorReply) -> None:
        """Answer the request ourselves; the request ends here and is counted here."""
        self._p.count(self._path, reply.kind.value)
        self._trace_outcome(reply.kind.value)
        fail(self._span, reply.message)
        log.warning(
            "request rejected: %s",
            reply.message,
            extra={
                "request_id": (self._headers or {}).get("x-request-id", ""),
                "path": self._path,
                "outcome": reply.kind.value,
                "status": reply.status,
            },
        )
        await self._write(immediate(reply))

    # -- request headers ------------------------------------------------------------------

    async def _on_request_headers(self, message: pb.HttpHeaders) -> None:
        started = time.perf_counter()
        if self._headers is not None:
            log.warning("duplicate request headers message; answered without processing")
            await self._write(_CONTINUE_REQUEST_HEADERS)
            return
        verdict = self._admit(header_dict(message), message.end_of_stream)
        if verdict is None:
            await self._passthrough(_PASSTHROUGH)
        elif verdict is _CHECK_ONLY:
            await self._write(_CHECK_BODY_ONLY)
        elif isinstance(verdict, ErrorReply):
            await self._reject(verdict)
        else:
            if self._unavailable is None:
                # Overlap a cache miss with Envoy sending the body.
                self._p.engines.prefetch(verdict, self._span)
            self._busy_s += time.perf_counter() - started
            await self._write(_CONTINUE_REQUEST_HEADERS)

    def _admit(
        self, headers: dict[str, str], end_of_stream: bool
    ) -> HostPort | ErrorReply | _CheckOnly | None:
        """Decide from the request headers: a prefill target, an error, a P/D-path request
        served by the decode alone whose body is still checked, or None (not P/D)."""
        self._headers = headers
        self._path = headers.get(":path", "").split("?", 1)[0]
        self._span = self._p.tracing.request_span(headers, self._path, headers.get(":method", ""))
        if (
            end_of_stream
            or headers.get(":method") != "POST"
            or self._path not in self._p.settings.pd_paths
        ):
            return None
        if self._p.draining:
            self._check_only = True
            return _CHECK_ONLY
        try:
            self._target = self._choose_target(headers.get(PREFILL_HEADER))
        except TargetError as exc:
            return ErrorReply(ErrorKind.BAD_REQUEST, str(exc))
        except PermissionError as exc:
            return ErrorReply(ErrorKind.FORBIDDEN, str(exc))
        if self._target is None:
            self._check_only = True
            return _CHECK_ONLY
        return self._target

    def _choose_target(self, header: str | None) -> HostPort | None:
        """The header's target (if allowed), else a pool member, else None (no P/D).

        A target whose circuit breaker is open is still returned, with `_unavailable` set:
        the body decides between rejecting and decode-only (`--on-bootstrap-error`)."""
        target = target_from_header([header]) if header else None
        if target is None:
            pool = self._p.pool()
            if not pool:
                return None
            member = self._p.pick_pool_member(pool)
            if member is None:
                self._unavailable = ErrorReply(
                    ErrorKind.PREFILL_UNAVAILABLE, "every prefill pool member is failing"
                )
                return pool[0]
            return member
        if not self._p.settings.allow.allows(target) and not self._p.is_pool_member(target):
            raise PermissionError(f"prefill target {target} is not allowed")
        if not self._p.breakers.allow(target):
            self._unavailable = ErrorReply(
                ErrorKind.PREFILL_UNAVAILABLE, f"prefill target {target} is failing (circuit open)"
            )
        return target

    async def _passthrough(self, answer: pb.ProcessingResponse) -> None:
        self._p.count(self._path, "passthrough")
        self._trace_outcome("passthrough")
        await self._write(answer)

    # -- request body ---------------------------------------------------------------------

    async def _on_request_body(self, request: pb.ProcessingRequest) -> None:
        message = request.request_body
        if self._headers is None and not self._body_done:
            # Single-message mode (request headers SKIP): the headers came as attributes.
            headers = headers_from_attributes(request)
            if headers is not None:
                self._single_message = True
                verdict = self._admit(headers, end_of_stream=False)
                if verdict is None:
                    self._body_done = True
                    await self._passthrough(_CONTINUE_REQUEST_BODY)
                    return
                if isinstance(verdict, ErrorReply):
                    self._body_done = True
                    await self._reject(verdict)
                    return
        if (self._target is None and not self._check_only) or self._body_done:
            # Passthrough whose override was not honoured, or a repeated end_of_stream.
            await self._write(_CONTINUE_REQUEST_BODY)
            return
        self._body_done = True
        started = time.perf_counter()
        if not message.end_of_stream:
            # Only BUFFERED delivers the whole body at once; a partial body means it outgrew
            # Envoy's buffer (BUFFERED_PARTIAL) and cannot be rewritten.
            await self._reject(ErrorReply(ErrorKind.TOO_LARGE, "request body too large to buffer"))
            return
        raw = message.body
        if len(raw) > self._p.settings.max_body_bytes:
            limit = self._p.settings.max_body_bytes
            await self._reject(
                ErrorReply(ErrorKind.TOO_LARGE, f"request body exceeds {limit} bytes")
            )
            return
        try:
            parsed = mooncake.parse_body(raw)
        except mooncake.BodyError as exc:
            await self._reject(ErrorReply(ErrorKind.BAD_REQUEST, str(exc)))
            return
        if mooncake.KV_PARAMS in parsed:
            # Only the gateway may point a decode pod at a KV source: a client's own params
            # could aim it at any address.
            await self._reject(
                ErrorReply(ErrorKind.BAD_REQUEST, f"{mooncake.KV_PARAMS} is set by the gateway")
            )
            return
        target = self._target
        if target is None:
            # No prefill for this request (draining, or no target): the decode serves it.
            await self._passthrough(_CHECKED_REQUEST_BODY)
            return
        if self._unavailable is not None:
            await self._no_prefill(raw, parsed, self._unavailable)
            return
        try:
            engines = await self._p.engines.get(target, self._span)
        except mooncake.BootstrapError as exc:
            self._p.breakers.record(target, POD_DOWN if exc.pod_down else "bootstrap")
            await self._no_prefill(raw, parsed, ErrorReply(ErrorKind.BOOTSTRAP, str(exc)))
            return
        rank, engine_id = mooncake.pick_rank(engines, self._p.launcher.in_flight_by_rank(target))
        transfer_id = mooncake.new_transfer_id()
        params = mooncake.decode_params(
            transfer_id, self._p.engines.bootstrap_addr(target), engine_id
        )
        body = mooncake.decode_body(raw, parsed, params)
        assert self._headers is not None
        job = self._job = self._p.launcher.launch(
            target=target,
            rank=rank,
            engine_id=engine_id,
            transfer_id=transfer_id,
            path=self._path,
            parsed=parsed,
            client_headers=self._headers,
            parent_span=self._span,
            body_excerpt=(
                raw[:4096].decode("utf-8", "replace") if self._p.settings.log_bodies else None
            ),
        )
        if self._span is not None:
            self._trace_outcome("pd")
            self._span.set_attribute(ATTR_TARGET, str(target))
            self._span.set_attribute(ATTR_TRANSFER_ID, transfer_id)
            self._span.set_attribute(ATTR_RANK, rank)
            self._span.set_attribute(ATTR_ENGINE_ID, engine_id)
        job.task.add_done_callback(self._on_prefill_done)
        self._busy_s += time.perf_counter() - started
        self._p.metrics.processing_seconds.observe(self._busy_s)
        await self._write(_body_response(body, content_length=not self._single_message))

    async def _no_prefill(self, raw: bytes, parsed: dict[str, Any], reply: ErrorReply) -> None:
        """No prefill can serve this request: reject it, or let the decode do it all alone."""
        if self._p.settings.on_bootstrap_error is BootstrapPolicy.REJECT:
            await self._reject(reply)
            return
        log.warning(
            "decode-only fallback: %s",
            reply.message,
            extra={"path": self._path, "outcome": "decode_only"},
        )
        self._p.count(self._path, "decode_only")
        self._trace_outcome("decode_only")
        await self._write(_CHECKED_REQUEST_BODY)
        self._target = None

    # -- prefill outcome and the decode's response headers ----------------------------------

    def _on_prefill_done(self, task: asyncio.Task[PrefillOutcome]) -> None:
        """A prefill failure seen before the decode answered aborts the decode at once."""
        if self._response_seen or self._finished:
            return
        outcome = _outcome(task)
        if not outcome.ok:
            self._p.metrics.aborts.labels("before_response").inc()
            self._trace_outcome(_prefill_error(outcome).kind.value)
            fail(self._span, outcome.error or outcome.outcome)
            self._abort = asyncio.get_running_loop().create_task(
                self._write(immediate(_prefill_error(outcome)))
            )

    async def _on_response_headers(self, message: pb.HttpHeaders) -> None:
        self._response_seen = True
        job = self._job
        if job is None:
            await self._write(_CONTINUE_RESPONSE_HEADERS)
            return
        status = header_dict(message).get(":status", "")
        if status.startswith("5"):
            # A decode 5xx may be a stale engine id (the prefill pod restarted): re-query.
            self._p.engines.invalidate(job.target)
        if job.task.done():
            await self._settle(job)
        elif not status.startswith("2"):
            # The decode failed on its own: the client sees its error; the prefill carries on.
            await self._write(_CONTINUE_RESPONSE_HEADERS)
        else:
            remaining = self._p.launcher.timeout_s - (time.perf_counter() - job.started)
            hold_s = min(max(remaining, 0.0) + 1.0, self._p.settings.envoy_max_message_timeout_s)
            # One override sized for the whole hold: Envoy honours only the first per message.
            await self._write(pb.ProcessingResponse(override_message_timeout=_duration(hold_s)))
            self._hold = asyncio.get_running_loop().create_task(self._hold_until_prefilled(job))

    async def _hold_until_prefilled(self, job: PrefillJob) -> None:
        started = time.perf_counter()
        await asyncio.wait([job.task])
        self._p.metrics.hold_seconds.observe(time.perf_counter() - started)
        await self._settle(job, held=True)

    async def _settle(self, job: PrefillJob, *, held: bool = False) -> None:
        """Answer the decode's response headers once the prefill is over: pass it on, or
        replace it with an error and make Envoy cancel the decode."""
        outcome = _outcome(job.task)
        if outcome.ok:
            await self._write(_CONTINUE_RESPONSE_HEADERS)
            return
        self._p.metrics.aborts.labels("held" if held else "before_response").inc()
        self._trace_outcome(_prefill_error(outcome).kind.value)
        fail(self._span, outcome.error or outcome.outcome)
        await self._write(immediate(_prefill_error(outcome)))


def _outcome(task: asyncio.Task[PrefillOutcome]) -> PrefillOutcome:
    if task.cancelled():
        return PrefillOutcome("error", 0.0, error="prefill cancelled")
    return task.result()


def _prefill_error(outcome: PrefillOutcome) -> ErrorReply:
    if outcome.outcome == "timeout":
        return ErrorReply(ErrorKind.PREFILL_TIMEOUT, f"prefill timed out: {outcome.error}")
    return ErrorReply(ErrorKind.PREFILL_FAILED, f"prefill failed: {outcome.error}")


def _body_response(body: bytes, content_length: bool = True) -> pb.ProcessingResponse:
    """The rewritten body. With the request headers still held by Envoy, content-length must
    change with it; in single-message mode they are gone upstream already and Envoy sends
    the body chunked."""
    # Filled in place: nesting constructors would copy a megabyte body once per level.
    response = pb.ProcessingResponse()
    common = response.request_body.response
    if content_length:
        length = str(len(body)).encode()
        common.header_mutation.set_headers.append(_header("content-length", length))
    common.body_mutation.body = body
    response.dynamic_metadata.CopyFrom(_CHECKED)
    return response


def _duration(seconds: float) -> Duration:
    whole = int(seconds)
    return Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
