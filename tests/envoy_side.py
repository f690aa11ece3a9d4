"""Envoy's side of an ext_proc stream, for every suite that drives pdproc over gRPC: a
channel as Envoy opens it, the messages Envoy sends (headers, the buffered body or its chunks,
the decode's response headers), a bounded read, and `play`: one whole request as Envoy drives
it, with what Envoy would then do with pdproc's answers (forward a body, skip a phase, answer
the client itself)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import grpc
import orjson
from prometheus_client.parser import text_string_to_metric_families

from pdproc._proto.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from pdproc._proto.envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import (
    ProcessingMode,
)
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from pdproc._proto.google.protobuf.struct_pb2 import Struct
from tests.metric_samples import sample_sum
from tests.waiting import eventually_async

if TYPE_CHECKING:
    from pdproc.server import Server
    from pdproc.service import ExtProcService

CHAT_PATH = "/v1/chat/completions"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 50}
# What `Pdproc.play` sends when no body is given.
DEFAULT_BODY = orjson.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
)
PREFILL_HEADER = "x-prefiller-host-port"
READ_TIMEOUT_S = 15.0
_ids = itertools.count(1)


@dataclass
class Outcome:
    """How one request ended, as the client and the decode pod would see it."""

    status: int  # the client's status: the decode's when pdproc let it answer
    # What Envoy forwarded to the decode (None: nothing). A request aborted after its body
    # was answered has both: the decode got this body, then Envoy reset it.
    decode_body: bytes | None
    error: dict[str, Any] | None = None  # pdproc's own JSON error answer
    error_kind: str | None = None  # its x-pdproc-error header
    raw_error: bytes = b""
    answers: list[pb.ProcessingResponse] = field(default_factory=list)

    @property
    def kv_params(self) -> dict[str, Any] | None:
        """The kv_transfer_params the decode receives (parsed with orjson)."""
        if self.decode_body is None:
            return None
        params = orjson.loads(self.decode_body).get("kv_transfer_params")
        return params if isinstance(params, dict) else None

    @property
    def disaggregated(self) -> bool:
        return self.status == 200 and self.kv_params is not None


def channel(port: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        f"127.0.0.1:{port}",
        options=[
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ],
    )


def request_headers(
    headers: dict[str, str | bytes], end_of_stream: bool = False
) -> pb.ProcessingRequest:
    """The request headers exactly as given (values may be any bytes)."""
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(
                headers=[
                    HeaderValue(key=k, raw_value=v if isinstance(v, bytes) else v.encode())
                    for k, v in headers.items()
                ]
            ),
            end_of_stream=end_of_stream,
        )
    )


def headers_msg(
    path: str = CHAT_PATH,
    method: str = "POST",
    extra: dict[str, str] | None = None,
    end_of_stream: bool = False,
) -> pb.ProcessingRequest:
    """A client's request headers, as Envoy's ext_proc filter sends them."""
    values: dict[str, str | bytes] = {
        ":method": method,
        ":path": path,
        ":authority": "gw",
        "x-request-id": "req-1",
    }
    values.update(extra or {})
    return request_headers(values, end_of_stream)


def body_msg(body: bytes | dict[str, Any], end_of_stream: bool = True) -> pb.ProcessingRequest:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=end_of_stream))


def response_headers_msg(status: str = "200") -> pb.ProcessingRequest:
    """The decode's response headers (the message pdproc may hold)."""
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=":status", raw_value=status.encode())])
        )
    )


def single_message_body(
    body: bytes, path: str, prefill: str | None, request_id: str
) -> pb.ProcessingRequest:
    """Single-message mode: the body with the request attributes Envoy adds, and the
    endpoint picker's header moved into dynamic metadata by header_to_metadata."""
    message = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    attributes = Struct()
    attributes.update({"request.path": path, "request.method": "POST", "request.id": request_id})
    message.attributes["envoy.filters.http.ext_proc"].CopyFrom(attributes)
    if prefill is not None:
        message.metadata_context.filter_metadata["pdproc"].update({"prefiller": prefill})
    return message


async def recv(call: Any, timeout_s: float = READ_TIMEOUT_S) -> pb.ProcessingResponse:
    """pdproc's next message on the stream (bounded)."""
    async with asyncio.timeout(timeout_s):
        message = await call.read()
    assert message is not grpc.aio.EOF, "pdproc ended the stream without an answer"
    assert isinstance(message, pb.ProcessingResponse)
    return message


async def _read_answer(call: Any, answers: list[pb.ProcessingResponse]) -> pb.ProcessingResponse:
    """The next real answer; a bare timeout override (the hold) is noted and skipped."""
    while True:
        message = await recv(call)
        answers.append(message)
        if message.WhichOneof("response") is not None:
            return message


def _ended(
    message: pb.ProcessingResponse,
    answers: list[pb.ProcessingResponse],
    forwarded: bytes | None = None,
) -> Outcome:
    immediate = message.immediate_response
    kinds = {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}
    kind = kinds.get("x-pdproc-error")
    try:
        error = orjson.loads(immediate.body)
    except orjson.JSONDecodeError:
        error = None
    return Outcome(
        status=immediate.status.code,
        decode_body=forwarded,
        error=error if isinstance(error, dict) else None,
        error_kind=kind.decode() if kind is not None else None,
        raw_error=immediate.body,
        answers=answers,
    )


async def _finish(call: Any) -> None:
    """Half-close like Envoy and let pdproc end the stream (bounded)."""
    with_eof = True
    try:
        await call.done_writing()
    except (grpc.aio.UsageError, grpc.aio.AioRpcError):
        with_eof = False
    if with_eof:
        async with asyncio.timeout(READ_TIMEOUT_S):
            while await call.read() is not grpc.aio.EOF:
                pass


async def play(
    stub: pb_grpc.ExternalProcessorStub,
    body: bytes,
    *,
    prefill: str | bytes | None = None,
    path: str = CHAT_PATH,
    decode_status: str = "200",
    extra_headers: dict[str, str | bytes] | None = None,
    single_message: bool = False,
) -> Outcome:
    """One request as Envoy drives it: returns what the client and the decode saw."""
    request_id = f"sec-{next(_ids)}"
    answers: list[pb.ProcessingResponse] = []
    call = stub.Process()
    try:
        if single_message:
            sent = await _send_single_message(call, answers, body, path, prefill, request_id)
        else:
            headers = _request_headers(path, request_id, prefill, extra_headers)
            sent = await _send_headers_and_body(call, answers, headers, body, decode_status)
        if isinstance(sent, Outcome):
            return sent
        return await _decode_answers(call, answers, sent, decode_status)
    finally:
        await _finish(call)


async def _send_single_message(
    call: Any,
    answers: list[pb.ProcessingResponse],
    body: bytes,
    path: str,
    prefill: str | bytes | None,
    request_id: str,
) -> bytes | Outcome:
    """Envoy in single-message mode: headers as attributes with the body. The body the
    decode gets, or the Outcome when pdproc answered the client itself."""
    value = prefill.decode("latin-1") if isinstance(prefill, bytes) else prefill
    await call.write(single_message_body(body, path, value, request_id))
    message = await _read_answer(call, answers)
    if message.HasField("immediate_response"):
        return _ended(message, answers)
    return _forwarded(message, body)


def _request_headers(
    path: str,
    request_id: str,
    prefill: str | bytes | None,
    extra_headers: dict[str, str | bytes] | None,
) -> dict[str, str | bytes]:
    headers: dict[str, str | bytes] = {
        ":method": "POST",
        ":path": path,
        ":authority": "gateway",
        "content-type": "application/json",
        "x-request-id": request_id,
        **(extra_headers or {}),
    }
    if prefill is not None:
        headers[PREFILL_HEADER] = prefill
    return headers


async def _send_headers_and_body(
    call: Any,
    answers: list[pb.ProcessingResponse],
    headers: dict[str, str | bytes],
    body: bytes,
    decode_status: str,
) -> bytes | Outcome:
    """Envoy in two-message mode: headers, then the body unless pdproc's mode override says
    not to send it. The body the decode gets, or the Outcome when the exchange ends here."""
    await call.write(request_headers(headers))
    message = await _read_answer(call, answers)
    if message.HasField("immediate_response"):
        return _ended(message, answers)
    mode = message.mode_override if message.HasField("mode_override") else None
    if mode is not None and mode.request_body_mode == ProcessingMode.NONE:
        # Pass-through: Envoy forwards the client's body unchanged, asks nothing more.
        return Outcome(int(decode_status), body, answers=answers)
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    message = await _read_answer(call, answers)
    if message.HasField("immediate_response"):
        return _ended(message, answers)
    forwarded = _forwarded(message, body)
    if mode is not None and mode.response_header_mode == ProcessingMode.SKIP:
        return Outcome(int(decode_status), forwarded, answers=answers)
    return forwarded


async def _decode_answers(
    call: Any, answers: list[pb.ProcessingResponse], forwarded: bytes, decode_status: str
) -> Outcome:
    """The decode answers; Envoy sends its response headers and waits for pdproc (an abort
    may already be on its way: then it is the next message read)."""
    await call.write(response_headers_msg(decode_status))
    message = await _read_answer(call, answers)
    if message.HasField("immediate_response"):
        return _ended(message, answers, forwarded)
    assert message.WhichOneof("response") == "response_headers", message
    return Outcome(int(decode_status), forwarded, answers=answers)


def _forwarded(message: pb.ProcessingResponse, body: bytes) -> bytes:
    """The body Envoy sends on after pdproc's body answer."""
    assert message.WhichOneof("response") == "request_body", message
    common = message.request_body.response
    if common.HasField("body_mutation"):
        return bytes(common.body_mutation.body)
    return body


class Pdproc:
    """A real pdproc `Server` in the test's process, and Envoy's side of its gRPC streams."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.channel = channel(server.port)
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.stopped = False

    @property
    def service(self) -> ExtProcService:
        assert self.server.service is not None
        return self.server.service

    def open(self) -> Any:
        """A new ext_proc stream, to write Envoy's messages on one by one."""
        return self.stub.Process()

    async def play(self, body: bytes = DEFAULT_BODY, **kw: Any) -> Outcome:
        """One whole request as Envoy drives it (see `play`)."""
        return await play(self.stub, body, **kw)

    def sample(self, name: str, **labels: str) -> float:
        """The sum of the samples `name` whose labels include `labels` (0 when none)."""
        return sample_sum(self.server.metrics.registry, name, **labels)

    async def metrics_page(self) -> str:
        """The /metrics page, scraped over HTTP as Prometheus would."""
        url = f"http://127.0.0.1:{self.server.metrics_port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 200
            return await response.text()

    async def series(self, name: str) -> list[dict[str, str]]:
        """The label sets of every sample of `name` on the /metrics page."""
        page = await self.metrics_page()
        return [
            dict(sample.labels)
            for family in text_string_to_metric_families(page)
            for sample in family.samples
            if sample.name == name
        ]

    async def stop(self, **kw: Any) -> int:
        self.stopped = True
        await self.channel.close()
        return await self.server.stop(**kw)

    @contextlib.asynccontextmanager
    async def lame_duck(self, drain_timeout_s: float, within_s: float) -> AsyncIterator[None]:
        """`Server.stop()` begun (NOT_SERVING, draining, still serving new streams) for as
        long as the block runs; then the stop goes on to its drain and must end within
        `within_s`. The block, not a timer, ends the lame duck: no test waits one out."""
        self.stopped = True
        stopping = asyncio.create_task(
            self.server.stop(drain_timeout_s=drain_timeout_s, lame_duck_s=3600)
        )
        try:
            await eventually_async(lambda: self.service.draining)
            yield
        finally:
            stopping.cancel()
            await asyncio.wait([stopping])
            if not stopping.cancelled():
                stopping.result()  # the stop failed before its lame duck: raise why
            await self.channel.close()
            async with asyncio.timeout(within_s):
                await self.server.stop(drain_timeout_s=drain_timeout_s)
