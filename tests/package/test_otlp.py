"""`OTEL_TRACES_EXPORTER=otlp pdproc serve` works from a plain install, whichever order pip
writes pdproc and the OTLP exporter in: spans reach an OTLP collector run here.

(pdproc used to depend on xds-protos, which ships an old copy of opentelemetry/proto/*;
depending on install order the exporter could not load and `pdproc serve` exited 2.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdproc._proto.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from .conftest import make_venv, pip_install

pytestmark = pytest.mark.package

EXPORTER = "opentelemetry-exporter-otlp-proto-grpc"
STARTUP_S = 60.0
SPAN_WAIT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module", params=["pdproc-last", "exporter-last"])
def install(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pdproc_wheel: Path
) -> Path:
    """A fresh virtualenv with the pdproc wheel and the OTLP exporter; `pdproc-last` writes
    pdproc's files after the exporter's, `exporter-last` the other way round. The venv's
    `pdproc` console script."""
    python = make_venv(tmp_path_factory.mktemp(request.param) / "venv")
    if request.param == "pdproc-last":
        pip_install(python, EXPORTER)
        pip_install(python, str(pdproc_wheel))
        pip_install(python, "--force-reinstall", "--no-deps", str(pdproc_wheel))
    else:
        pip_install(python, str(pdproc_wheel))
        pip_install(python, "--force-reinstall", "--no-deps", EXPORTER, "opentelemetry-proto")
    return python.with_name("pdproc")


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, str]] = []  # (service.name, span name)

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append((attributes.get("service.name", ""), span.name))
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.asynccontextmanager
async def collector() -> AsyncIterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, port
    finally:
        await server.stop(None)


async def wait_serving(channel: grpc.aio.Channel, process: asyncio.subprocess.Process) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = asyncio.get_running_loop().time() + STARTUP_S
    while True:
        assert process.returncode is None, f"pdproc serve exited {process.returncode}"
        try:
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
            if answer.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        assert asyncio.get_running_loop().time() < deadline, "pdproc serve never became SERVING"
        await asyncio.sleep(0.1)


def get_request() -> pb.ProcessingRequest:
    headers = {":method": "GET", ":path": "/v1/models", ":authority": "gw", "x-request-id": "r"}
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(
                headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
            ),
            end_of_stream=True,
        )
    )


async def test_otlp_export_from_a_plain_install(install: Path, tmp_path: Path) -> None:
    async with collector() as (spans, collector_port):
        port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        log = (tmp_path / "pdproc.log").open("wb")
        process = await asyncio.create_subprocess_exec(
            str(install),
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--shutdown-delay",
            "0",
            "--log-format",
            "text",
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=log,
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await wait_serving(channel, process)
                stream = pb_grpc.ExternalProcessorStub(channel).Process()
                await stream.write(get_request())
                answer = await asyncio.wait_for(stream.read(), 30)
                await stream.done_writing()
                assert isinstance(answer, pb.ProcessingResponse)
                assert answer.HasField("request_headers")
            deadline = asyncio.get_running_loop().time() + SPAN_WAIT_S
            while ("pdproc", "pdproc.request") not in spans.spans:
                assert process.returncode is None, f"pdproc serve exited {process.returncode}"
                assert asyncio.get_running_loop().time() < deadline, f"no span: {spans.spans}"
                await asyncio.sleep(0.1)
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), 30)
                except TimeoutError:
                    process.kill()
                    await process.wait()
            log.close()
        assert process.returncode == 0, (tmp_path / "pdproc.log").read_text()[-3000:]
