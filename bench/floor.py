"""The floor: the smallest correct Python Mooncake P/D ext_proc, for `bench.run --configs floor`.

grpc.aio + aiohttp + orjson behind the same `pdproc envoy-config` output (two-message mode):
request headers -> continue (mode_override when there is no prefill target), buffered body ->
engine id from the prefill pod's bootstrap `/query` (cached per host), `kv_transfer_params`
spliced into the decode body, the prefill launched detached, the new body answered;
response headers -> continue. No allow list, breaker, hold, metrics or tracing: what any
Python processor pays, so `pdproc` minus `floor` is what pdproc's own features cost.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import signal
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import orjson
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdproc._proto.envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from pdproc._proto.envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import (
    ProcessingMode,
)
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from pdproc._proto.envoy.type.v3.http_status_pb2 import HttpStatus

KV = "kv_transfer_params"
CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
SKIP_REST = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(),
    mode_override=ProcessingMode(
        request_body_mode=ProcessingMode.NONE, response_header_mode=ProcessingMode.SKIP
    ),
)
CONTINUE_RESPONSE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
# The envoy-config kv guard lets through only bodies the processor marked as checked.
CHECKED = pb.ProcessingResponse()
CHECKED.dynamic_metadata.update({"pdproc": {"body_checked": True}})
BAD_REQUEST = pb.ProcessingResponse(
    immediate_response=pb.ImmediateResponse(status=HttpStatus(code=400), body=b"bad body")
)


class Floor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, bootstrap_port: int) -> None:
        self.bootstrap_port = bootstrap_port
        self.engines: dict[str, str] = {}  # prefill host -> engine id of its rank 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def Process(
        self, requests: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        headers: dict[str, str] = {}
        async for request in requests:
            kind = request.WhichOneof("request")
            if kind == "request_headers":
                pairs = request.request_headers.headers.headers
                headers = {h.key: h.raw_value.decode() for h in pairs}
                pd = "x-prefiller-host-port" in headers and headers.get(":method") == "POST"
                yield CONTINUE_HEADERS if pd else SKIP_REST
            elif kind == "request_body":
                yield await self.body(headers, request.request_body.body)
            elif kind == "response_headers":
                yield CONTINUE_RESPONSE

    async def body(self, headers: dict[str, str], raw: bytes) -> pb.ProcessingResponse:
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return BAD_REQUEST
        if not isinstance(parsed, dict) or KV in parsed:
            return BAD_REQUEST
        target = headers["x-prefiller-host-port"]
        host = target.rpartition(":")[0]
        bootstrap = f"http://{host}:{self.bootstrap_port}"
        engine = self.engines.get(host)
        if engine is None:
            async with self.http.get(bootstrap + "/query") as answer:
                ranks = orjson.loads(await answer.read())
            engine = self.engines[host] = ranks["0"]["engine_id"]
        xfer = f"xfer-{uuid.uuid4()}"
        decode = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": xfer}
        decode |= {"remote_bootstrap_addr": bootstrap, "remote_engine_id": engine}
        cut = raw.rindex(b"}")
        body = raw[:cut] + b"," * bool(parsed) + b'"' + KV.encode() + b'":' + orjson.dumps(decode)
        body += b"}"
        prefill = {**parsed, "max_tokens": 1, "stream": False}
        prefill.pop("stream_options", None)
        prefill[KV] = {"do_remote_prefill": False, "do_remote_decode": True, "transfer_id": xfer}
        send = {"content-type": "application/json", "x-data-parallel-rank": "0"}
        send["x-request-id"] = headers.get("x-request-id", xfer)
        url = f"http://{target}{headers[':path']}"
        task = asyncio.create_task(self.prefill(url, orjson.dumps(prefill), send))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        out = pb.ProcessingResponse()
        out.CopyFrom(CHECKED)
        common = out.request_body.response
        length = HeaderValue(key="content-length", raw_value=str(len(body)).encode())
        common.header_mutation.set_headers.append(HeaderValueOption(header=length))
        common.body_mutation.body = body
        return out

    async def prefill(self, url: str, body: bytes, headers: dict[str, str]) -> None:
        async with self.http.post(url, data=body, headers=headers) as answer:
            await answer.read()


async def serve(listen: str, bootstrap_port: int) -> None:
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 1)]
    )
    pb_grpc.add_ExternalProcessorServicer_to_server(Floor(bootstrap_port), server)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    server.add_insecure_port(listen)
    await server.start()
    for name in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
        await checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    gc.freeze()  # the same runtime settings as pdproc, so the difference is the code
    gc.set_threshold(50_000, 20, 100)
    await server.wait_for_termination()


def run(listen: str, bootstrap_port: int) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(listen, bootstrap_port))
    else:
        uvloop.run(serve(listen, bootstrap_port))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:9002")
    parser.add_argument("--bootstrap-port", type=int, default=8998)
    parser.add_argument("--workers", type=int, default=1, help="processes on one port")
    args = parser.parse_args()
    if args.workers <= 1:
        return run(args.listen, args.bootstrap_port)
    spawn = multiprocessing.get_context("spawn")
    workers = [
        spawn.Process(target=run, args=(args.listen, args.bootstrap_port), daemon=True)
        for _ in range(args.workers)
    ]
    for worker in workers:
        worker.start()

    def stop(*_: object) -> None:
        for worker in workers:
            worker.terminate()

    signal.signal(signal.SIGTERM, stop)
    for worker in workers:
        worker.join()


if __name__ == "__main__":
    main()
