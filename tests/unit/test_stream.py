"""One ext_proc stream, driven through a fake gRPC context (tests/unit/fakes.py) as Envoy
would drive it, with real processors on fake dependencies: the phase it waits in, one
answer per message, and exactly one outcome per request whatever ends the stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
import orjson
import pytest
from google.protobuf.message import DecodeError

from pdproc import extproc_messages as msg
from pdproc._proto.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc._proto.google.protobuf.struct_pb2 import Struct
from pdproc.connectors.mooncake import Mooncake
from pdproc.errors import ErrorKind, ErrorReply
from pdproc.ledger import Ledger
from pdproc.outcomes import Outcome, PrefillResult
from pdproc.processors import (
    Abort,
    ConcurrentPair,
    DecodeOnly,
    Deferred,
    PassThrough,
    RequestContext,
    RequestProcessor,
)
from pdproc.stream import Phase, Stream

from .fakes import CHAT_BYTES, PATH, POD, FakeCall, World, settle

Make = Callable[[World, RequestContext, Abort], RequestProcessor]


def pair(w: World, context: RequestContext, abort: Abort) -> RequestProcessor:
    return ConcurrentPair(context, w.deps, Mooncake(8998), POD, abort)


def decode_only(w: World, context: RequestContext, abort: Abort) -> RequestProcessor:
    return DecodeOnly(context, w.deps, Outcome.PASSTHROUGH)


def pass_through(w: World, context: RequestContext, abort: Abort) -> RequestProcessor:
    return PassThrough(context)


class Requests:
    """The service's part (pdproc.service.ExtProcService): a processor per request."""

    def __init__(self, world: World, make: Make = pair) -> None:
        self.world = world
        self.make = make
        self.opened: list[dict[str, Any]] = []
        self.fail_open = False

    def open_request(
        self,
        headers: dict[str, str],
        end_of_stream: bool,
        *,
        single_message: bool,
        call_metadata: Callable[[], Mapping[str, str]],
        abort: Abort,
    ) -> RequestProcessor:
        if self.fail_open:
            raise RuntimeError("simulated bug")
        self.opened.append({"headers": headers, "metadata": call_metadata()})
        ledger = Ledger(self.world.counted, PATH)
        context = RequestContext(headers, PATH, None, ledger, single_message=single_message)
        if end_of_stream:
            return PassThrough(context)
        return self.make(self.world, context, abort)

    def ledger(self, path: str) -> Ledger:
        return Ledger(self.world.counted, path)


class Driver:
    """Envoy's side: messages in, answers out, then the stream's end as the service does."""

    def __init__(self, requests: Requests, call: FakeCall | None = None) -> None:
        self.call = call or FakeCall(metadata=(("traceparent", "00-abc"), ("bin-bin", b"\x00")))
        self.stream = Stream(requests, self.call)
        self.task = asyncio.get_running_loop().create_task(self.stream.run())

    async def ask(self, message: pb.ProcessingRequest | BaseException) -> pb.ProcessingResponse:
        self.call.send(message)
        return await self.call.next_write()

    async def end(self) -> None:
        self.call.end()
        await self.finish()

    async def finish(self) -> None:
        async with asyncio.timeout(10):
            await self.task
        self.stream.close()


@pytest.fixture
async def world() -> AsyncIterator[World]:
    w = World()
    yield w
    await w.launcher.close()


def headers(
    end_of_stream: bool = False, extra: Mapping[str, str] | None = None
) -> pb.ProcessingRequest:
    values = {":method": "POST", ":path": PATH, "x-request-id": "req-1", **(extra or {})}
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(
                headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
            ),
            end_of_stream=end_of_stream,
        )
    )


def body(raw: bytes = CHAT_BYTES, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=end_of_stream))


def response(code: str = "200") -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=":status", raw_value=code.encode())])
        )
    )


def single_message_body(raw: bytes = CHAT_BYTES) -> pb.ProcessingRequest:
    attributes = Struct()
    attributes.update({"request.path": PATH, "request.method": "POST"})
    message = body(raw)
    message.attributes[msg.ATTRIBUTES_KEY].CopyFrom(attributes)
    return message


def kind(answer: pb.ProcessingResponse) -> str:
    return str(answer.WhichOneof("response"))


# --- one answer per message, in its phase ------------------------------------------------


async def test_a_pd_request_from_headers_to_the_decodes_answer(world: World) -> None:
    requests = Requests(world)
    d = Driver(requests)
    assert d.stream.phase is Phase.REQUEST_HEADERS
    assert kind(await d.ask(headers())) == "request_headers"
    assert d.stream.phase is Phase.REQUEST_BODY  # type: ignore[comparison-overlap]
    assert requests.opened[0]["metadata"] == {"traceparent": "00-abc"}  # text metadata only
    decode = await d.ask(body())
    assert orjson.loads(decode.request_body.response.body_mutation.body)["kv_transfer_params"]
    assert d.stream.phase is Phase.RESPONSE_HEADERS
    await settle(world.launcher.job, PrefillResult.OK, status=200)
    assert kind(await d.ask(response())) == "response_headers"
    assert d.stream.phase is Phase.RESPONSE
    # Whatever else the filter sends is let through.
    trailing = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x"))
    assert kind(await d.ask(trailing)) == "response_body"
    await d.end()
    assert world.counted.only is Outcome.PD


async def test_a_held_answer_asks_envoy_to_wait_first_when_it_is_late(world: World) -> None:
    world = World(envoy_message_timeout=0.001)  # the hold goes out at once
    d = Driver(Requests(world))
    await d.ask(headers())
    await d.ask(body())
    d.call.send(response())
    hold = await d.call.next_write()
    assert hold.HasField("override_message_timeout")
    await settle(world.launcher.job, PrefillResult.OK, status=200)
    assert kind(await d.call.next_write()) == "response_headers"
    await d.end()
    assert world.counted.only is Outcome.PD
    await world.launcher.close()


async def test_a_prefill_failing_before_the_decode_answers_ends_the_request(
    world: World,
) -> None:
    d = Driver(Requests(world))
    await d.ask(headers())
    await d.ask(body())
    await settle(world.launcher.job, PrefillResult.SERVER_ERROR, status=500, error="status 500")
    abort = await d.call.next_write()
    assert abort.immediate_response.status.code == 502
    assert d.stream.phase is Phase.DONE
    # Envoy may still deliver what it had sent: nothing more is answered.
    d.call.send(response())
    await d.end()
    assert len(d.call.written) == 3
    assert world.counted.only is Outcome.PREFILL_FAILED


async def test_an_abort_after_the_decode_answered_is_not_written(world: World) -> None:
    d = Driver(Requests(world))
    await d.ask(headers())
    await d.ask(body())
    assert kind(await d.ask(response("503"))) == "response_headers"
    processor = d.stream._processor
    assert processor is not None
    d.stream._abort(msg.immediate(ErrorReply(ErrorKind.INTERNAL, "late")))
    await d.end()
    assert len(d.call.written) == 3


async def test_a_request_with_no_body_passes_and_skips_the_body_phase(world: World) -> None:
    d = Driver(Requests(world))
    assert kind(await d.ask(headers(end_of_stream=True))) == "request_headers"
    assert d.stream.phase is Phase.RESPONSE_HEADERS
    await d.end()
    assert world.counted.only is Outcome.PASSTHROUGH


async def test_single_message_mode_opens_the_request_at_its_body(world: World) -> None:
    requests = Requests(world, decode_only)
    d = Driver(requests)
    answer = await d.ask(single_message_body())
    assert answer == msg.CHECKED_REQUEST_BODY
    assert requests.opened[0]["headers"][":path"] == PATH
    await d.end()
    assert world.counted.only is Outcome.PASSTHROUGH


async def test_messages_out_of_place_are_answered_without_processing(world: World) -> None:
    requests = Requests(world)
    d = Driver(requests)
    # A body before any headers, and a trailers message before any request.
    assert await d.ask(body()) == msg.CONTINUE_REQUEST_BODY
    assert await d.ask(pb.ProcessingRequest(request_trailers=pb.HttpTrailers())) == (
        msg.CONTINUE_REQUEST_TRAILERS
    )
    assert await d.ask(response()) == msg.CONTINUE_RESPONSE_HEADERS
    assert await d.ask(pb.ProcessingRequest()) == msg.CONTINUE_REQUEST_BODY  # unknown kind
    assert requests.opened == []
    await d.end()
    assert world.counted.outcomes == []  # no request ever began


async def test_repeated_headers_and_bodies_are_answered_without_processing(
    world: World,
) -> None:
    requests = Requests(world, decode_only)
    d = Driver(requests)
    await d.ask(headers())
    assert await d.ask(headers()) == msg.CONTINUE_REQUEST_HEADERS
    await d.ask(body())
    assert await d.ask(body()) == msg.CONTINUE_REQUEST_BODY
    await d.end()
    assert len(requests.opened) == 1
    assert world.counted.only is Outcome.PASSTHROUGH


async def test_trailers_after_a_streamed_bodys_chunks_are_refused() -> None:
    world = World(stream_body_bytes=64)
    large = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "p" * 200}]})
    d = Driver(Requests(world))
    await d.ask(headers(extra={"content-length": str(len(large))}))
    await d.ask(body(large[:100], end_of_stream=False))
    refused = await d.ask(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert refused.immediate_response.status.code == 400
    await d.end()
    assert world.counted.only is Outcome.BAD_REQUEST


# --- exactly one outcome, whatever ends the stream -----------------------------------------


@pytest.mark.parametrize("make", [pair, decode_only])
async def test_a_stream_ending_between_headers_and_body_is_counted_once(
    world: World, make: Make
) -> None:
    d = Driver(Requests(world, make))
    await d.ask(headers())
    await d.end()
    assert world.counted.only is Outcome.ABANDONED


async def test_a_stream_ending_with_its_prefill_running_cancels_it(world: World) -> None:
    d = Driver(Requests(world))
    await d.ask(headers())
    await d.ask(body())
    await asyncio.sleep(0)
    await d.end()
    assert world.counted.only is Outcome.CANCELLED
    job = world.launcher.job
    assert job.task is not None
    await asyncio.gather(job.task, return_exceptions=True)
    assert job.outcome.result().outcome is PrefillResult.CANCELLED


async def test_a_stream_ending_while_the_decode_is_held_cancels_it(world: World) -> None:
    d = Driver(Requests(world))
    await d.ask(headers())
    await d.ask(body())
    d.call.send(response())
    await d.end()  # the held answer is never written
    assert world.counted.only is Outcome.CANCELLED


async def test_a_cancelled_grpc_call_is_counted_like_an_ended_one(world: World) -> None:
    d = Driver(Requests(world))
    await d.ask(headers())
    d.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await d.task
    d.stream.close()
    assert world.counted.only is Outcome.ABANDONED


async def test_an_unreadable_first_message_is_a_counted_400(world: World) -> None:
    d = Driver(Requests(world))
    answer = await d.ask(DecodeError("bad utf-8"))
    assert answer.immediate_response.status.code == 400
    await d.finish()
    assert world.counted.outcomes == [("", Outcome.BAD_REQUEST)]


async def test_an_unreadable_message_mid_request_is_counted_once(world: World) -> None:
    """The request's own ledger counts it: a request already counted (here: passed through)
    is not counted a second time under another path."""
    d = Driver(Requests(world, pass_through))
    await d.ask(headers())
    answer = await d.ask(DecodeError("bad utf-8"))
    assert answer.immediate_response.status.code == 400
    await d.finish()
    assert world.counted.only is Outcome.PASSTHROUGH


async def test_a_bug_before_any_processor_is_a_counted_500(world: World) -> None:
    requests = Requests(world)
    requests.fail_open = True
    d = Driver(requests)
    answer = await d.ask(headers())
    assert answer.immediate_response.status.code == 500
    await d.end()
    assert world.counted.outcomes == [("", Outcome.INTERNAL_ERROR)]


async def test_a_bug_in_a_processor_is_a_counted_500(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any) -> Any:
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(ConcurrentPair, "request_body", broken)
    d = Driver(Requests(world))
    await d.ask(headers())
    answer = await d.ask(body())
    assert answer.immediate_response.status.code == 500
    await d.end()
    assert world.counted.only is Outcome.INTERNAL_ERROR


async def test_a_bug_in_a_deferred_answer_is_a_counted_500(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*_: Any) -> Any:
        raise RuntimeError("simulated bug")

    async def deferred(self: Any, *_: Any) -> Deferred:
        return Deferred(broken(), lambda: msg.hold(1.0), hold_after=60.0)

    monkeypatch.setattr(ConcurrentPair, "request_body", deferred)
    d = Driver(Requests(world))
    await d.ask(headers())
    d.call.send(body())
    answer = await d.call.next_write()
    assert answer.immediate_response.status.code == 500
    await d.end()
    assert world.counted.only is Outcome.INTERNAL_ERROR


async def test_writes_after_envoy_closed_the_stream_are_dropped(world: World) -> None:
    call = FakeCall()
    call.fail_writes = grpc.aio.UsageError("stream closed")
    d = Driver(Requests(world, decode_only), call)
    call.send(headers())
    call.send(body())
    await d.end()
    assert call.written == []
    assert world.counted.only is Outcome.PASSTHROUGH  # the body was answered (unsent)


async def test_an_answer_ready_after_the_request_ended_is_not_written(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    ready = asyncio.Event()

    async def later() -> pb.ProcessingResponse:
        await ready.wait()
        return msg.CHECKED_REQUEST_BODY

    async def deferred(self: Any, *_: Any) -> Deferred:
        return Deferred(later(), lambda: msg.hold(1.0), hold_after=60.0)

    monkeypatch.setattr(ConcurrentPair, "request_body", deferred)
    d = Driver(Requests(world))
    await d.ask(headers())
    d.call.send(body())
    await asyncio.sleep(0)
    d.stream._abort(msg.immediate(ErrorReply(ErrorKind.PREFILL_FAILED, "prefill failed")))
    assert (await d.call.next_write()).immediate_response.status.code == 502
    ready.set()
    for _ in range(3):
        await asyncio.sleep(0)
    await d.end()
    assert len(d.call.written) == 2  # the headers' answer and the abort, nothing after


async def test_a_prefill_cancelled_for_a_client_that_left_is_no_abort(world: World) -> None:
    d = Driver(Requests(world))
    await d.ask(headers())
    await d.ask(body())
    await asyncio.sleep(0)
    await d.end()
    await world.launcher.close()
    await asyncio.sleep(0)
    aborts = world.metrics.registry.get_sample_value(
        "pdproc_decode_aborts_total", {"when": "before_response"}
    )
    assert not aborts  # nothing was aborted: the client had gone
    assert world.counted.only is Outcome.CANCELLED
