"""ProcessingRequest builders and a bounded read, as Envoy would send and read them."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import orjson

from pdproc._proto.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 50}


def headers_msg(
    path: str = "/v1/chat/completions",
    method: str = "POST",
    extra: dict[str, str] | None = None,
    end_of_stream: bool = False,
) -> pb.ProcessingRequest:
    values = {":method": method, ":path": path, ":authority": "gw", "x-request-id": "req-1"}
    values.update(extra or {})
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(
                headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
            ),
            end_of_stream=end_of_stream,
        )
    )


def body_msg(body: bytes | dict[str, Any], end_of_stream: bool = True) -> pb.ProcessingRequest:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=end_of_stream))


def response_headers_msg(status: str = "200") -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=":status", raw_value=status.encode())])
        )
    )


async def recv(call: Any, timeout_s: float = 10.0) -> pb.ProcessingResponse:
    async with asyncio.timeout(timeout_s):
        message = await call.read()
    assert message is not grpc.aio.EOF
    assert isinstance(message, pb.ProcessingResponse)
    return message
