"""One ext_proc stream (one HTTP request): phases, one answer per message, one writer.

Envoy sends the request headers, the buffered body and the decode's response headers, in
that order, and waits for exactly one answer to each, in order. The stream tracks which of
those it is waiting for (`Phase`), hands each message to the request's processor
(pass-through, decode-only, rejected or disaggregated: chosen when the request's headers
arrive) and writes what the processor returns. A processor may defer an answer (the hold
on the decode's response headers) or end the request early (an unsolicited immediate
response when the prefill fails); both go through `_write`, the only place that writes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError

from pdproc import extproc_messages as msg
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc.errors import ErrorKind, ErrorReply
from pdproc.extproc_wire import BodyRequest
from pdproc.outcomes import Outcome
from pdproc.processors import Deferred, RequestProcessor

if TYPE_CHECKING:
    # Where a stream's request gets its processor (tests hand in a stand-in of its shape).
    from pdproc.service import ExtProcService

log = logging.getLogger(__name__)

# What gRPC reads and writes (pdproc.extproc_wire's (de)serializers).
ServicerContext: TypeAlias = (
    "grpc.aio.ServicerContext[pb.ProcessingRequest | BodyRequest, msg.Answer]"
)


class Phase(Enum):
    """What the stream waits for next."""

    REQUEST_HEADERS = "request_headers"  # (or, in single-message mode, the body)
    REQUEST_BODY = "request_body"
    RESPONSE_HEADERS = "response_headers"
    RESPONSE = "response"  # past the response headers: only trailing messages remain
    DONE = "done"  # an immediate response went out: Envoy is closing the stream


class Stream:
    def __init__(self, requests: ExtProcService, context: ServicerContext) -> None:
        self._requests = requests
        self._context = context
        self.phase = Phase.REQUEST_HEADERS
        self._processor: RequestProcessor | None = None
        self._write_lock = asyncio.Lock()
        # The decode's answer went on to the client (its response headers were answered).
        self._answered = False
        # Writes that run beside the message loop (a deferred answer, an abort): held so
        # they are not collected before they have written, cancelled if the stream ends.
        self._background: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        while True:
            try:
                message = await self._context.read()
            except DecodeError as exc:
                # A message protobuf cannot parse: header bytes that are not UTF-8, which
                # Envoy copies into string attributes in single-message mode. Whatever it
                # was, the request ends here rather than failing the stream (Envoy would
                # fail open, and the client would pass unchecked).
                log.warning("unreadable ext_proc message: %s", exc)
                reply = ErrorReply(ErrorKind.BAD_REQUEST, "request headers are not valid UTF-8")
                await self._write(self._refuse(reply))
                return
            if message is grpc.aio.EOF:
                return  # Envoy resets the stream right after: leave now
            if self.phase is Phase.DONE:
                continue  # the whole request is answered; nothing more is expected
            try:
                answer = await self._answer(message)
            except Exception:
                # A bug must not turn into a gRPC error (a bare 500, or with fail-open a
                # request silently not disaggregated): answer it, log it, count it.
                log.exception("ext_proc message handling failed")
                answer = self._internal_error()
            # Neither waits here for the next message: a long prompt's body and its rewritten
            # answer would stay alive until the decode answers, for every open stream.
            del message
            await self._deliver(answer)
            del answer

    def _internal_error(self) -> msg.Answer:
        return self._refuse(ErrorReply(ErrorKind.INTERNAL, "internal error in pdproc"))

    def _refuse(self, reply: ErrorReply) -> msg.Answer:
        """Answer in Envoy's place, counted in the request's ledger (a stream that never
        became a request gets one of its own)."""
        if self._processor is not None:
            return self._processor.context.reject(reply)
        self._requests.ledger("").record(Outcome.of(reply.kind))
        return msg.immediate(reply)

    def close(self) -> None:
        """The stream ended, whatever ended it: its request's ledger is settled here."""
        for task in self._background:
            task.cancel()
        processor = self._processor
        if processor is None:
            return
        # Ended before the decode's answer reached the client: the client left (or Envoy
        # gave up), at whatever phase.
        outcome = processor.close(abandoned=not self._answered and self.phase is not Phase.DONE)
        if outcome is not None:
            processor.context.finish(outcome)
        processor.context.close()

    async def _answer(self, message: pb.ProcessingRequest | BodyRequest) -> msg.Answer | Deferred:
        if isinstance(message, BodyRequest):
            return await self._request_body(message)
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(message.request_headers)
        if kind == "response_headers":
            self.phase = Phase.RESPONSE
            if self._processor is None:
                return msg.CONTINUE_RESPONSE_HEADERS
            return self._processor.response_headers(message.response_headers)
        if kind == "request_trailers":
            return self._request_trailers(message)
        if kind in msg.CONTINUE:
            return msg.CONTINUE[kind]
        log.warning("unexpected ext_proc message %r ignored", kind)
        return msg.CONTINUE_REQUEST_BODY

    def _request_trailers(self, message: pb.ProcessingRequest) -> msg.Answer | Deferred:
        processor = self._processor
        if processor is None and self.phase is Phase.REQUEST_HEADERS:
            # Single-message mode, trailers and no body: the trailers are the first message,
            # and carry the request's attributes.
            attributes = msg.headers_from_attributes(message)
            if attributes is not None:
                processor = self._open(attributes, False, single_message=True)
                self.phase = Phase.REQUEST_BODY
        if processor is None or self.phase is not Phase.REQUEST_BODY:
            return msg.CONTINUE_REQUEST_TRAILERS
        self.phase = Phase.RESPONSE_HEADERS
        return processor.request_trailers()

    async def _request_headers(self, headers: pb.HttpHeaders) -> msg.Answer | Deferred:
        if self.phase is not Phase.REQUEST_HEADERS or self._processor is not None:
            log.warning("duplicate request headers message; answered without processing")
            return msg.CONTINUE_REQUEST_HEADERS
        end = headers.end_of_stream
        processor = self._open(msg.header_dict(headers), end, single_message=False)
        self.phase = Phase.RESPONSE_HEADERS if end else Phase.REQUEST_BODY
        return await processor.request_headers()

    async def _request_body(self, message: BodyRequest) -> msg.Answer | Deferred:
        processor = self._processor
        if processor is None and self.phase is Phase.REQUEST_HEADERS:
            # Single-message mode (request headers SKIP): the headers came as attributes.
            attributes = msg.headers_from_attributes(message.rest)
            if attributes is None:
                return msg.CONTINUE_REQUEST_BODY  # a body before any headers
            processor = self._open(attributes, False, single_message=True)
            self.phase = Phase.REQUEST_BODY
        if processor is None or self.phase is not Phase.REQUEST_BODY:
            return msg.CONTINUE_REQUEST_BODY  # a repeated end_of_stream
        if message.request_body.end_of_stream:
            self.phase = Phase.RESPONSE_HEADERS
        return await processor.request_body(message.request_body)

    def _open(
        self, headers: dict[str, str], end_of_stream: bool, *, single_message: bool
    ) -> RequestProcessor:
        processor = self._requests.open_request(
            headers,
            end_of_stream,
            single_message=single_message,
            call_metadata=self._call_metadata,
            abort=self._abort,
        )
        self._processor = processor
        return processor

    def _call_metadata(self) -> dict[str, str]:
        """The gRPC call's text metadata (Envoy's trace context), read only when wanted."""
        return {
            key: value
            for key, value in self._context.invocation_metadata() or ()
            if isinstance(value, str)
        }

    def _abort(self, response: msg.Answer) -> None:
        """End the request now, unasked (the prefill failed before the decode answered)."""
        if self.phase is Phase.RESPONSE or self.phase is Phase.DONE:
            return
        self._in_background(self._write(response))

    async def _deliver(self, answer: msg.Answer | Deferred) -> None:
        if isinstance(answer, Deferred):
            self._in_background(self._write_later(answer))
        else:
            await self._write(answer)

    def _in_background(self, write: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(write)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _write_later(self, deferred: Deferred) -> None:
        """Write a deferred answer; if it keeps Envoy waiting long, ask Envoy to wait."""
        loop = asyncio.get_running_loop()
        held: list[asyncio.Task[None]] = []
        timer = loop.call_later(
            deferred.hold_after, lambda: held.append(loop.create_task(self._write(deferred.hold())))
        )
        try:
            answer = await deferred.later
        except Exception:
            # As for an answer given at once: a bug is a counted 500, never a silent timeout.
            log.exception("ext_proc deferred answer failed")
            answer = self._internal_error()
        finally:
            timer.cancel()
        if held:
            await held[0]  # the override goes out before the answer it makes room for
        await self._write(answer)

    async def _write(self, response: msg.Answer) -> None:
        async with self._write_lock:
            if self.phase is Phase.DONE:
                return
            if msg.ends_request(response):
                self.phase = Phase.DONE
            try:
                await self._context.write(response)
                if msg.answers_response_headers(response):
                    self._answered = True
            except (grpc.aio.AbortError, grpc.aio.UsageError, RuntimeError) as exc:
                # Envoy already closed the stream (client gone): nothing can be answered.
                log.debug("ext_proc write after stream end: %r", exc)
