"""pdproc's Envoy API stubs (pdproc/_proto, generated from protos/) live in a private module
namespace and descriptor pool: they load next to another copy of the same API in one process
(xds-protos here), speak the same wire, and work on protobuf's pure-Python backend too."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from google.protobuf import descriptor_pool

from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

pytestmark = pytest.mark.package

# A copy of the same API that registers itself in protobuf's default pool, under the
# import package `envoy` (pinned: its generated code must suit the installed protobuf).
XDS_PROTOS = "xds-protos==1.85.0"
RUN_TIMEOUT_S = 120

# Run in a subprocess with xds-protos on PYTHONPATH; argv[1] says which copy loads first.
COEXIST = textwrap.dedent(
    """
    import asyncio, sys

    import grpc
    from google.protobuf import descriptor_pool


    def ours():
        from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
        from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as g
        from pdproc._proto.envoy.config.core.v3 import base_pb2 as base
        from pdproc._proto.google.protobuf import duration_pb2 as duration
        return pb, g, base, duration


    def theirs():
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as g
        from envoy.config.core.v3 import base_pb2 as base
        from google.protobuf import duration_pb2 as duration
        return pb, g, base, duration


    if sys.argv[1] == "pdproc-first":
        a, b = ours(), theirs()
    else:
        b, a = theirs(), ours()
    pb, g, base, duration = a
    xpb, xg, xbase, xduration = b
    assert "xds_protos" in xpb.__file__, xpb.__file__
    assert pb.ProcessingRequest.DESCRIPTOR.full_name == xpb.ProcessingRequest.DESCRIPTOR.full_name
    assert pb.DESCRIPTOR.name == xpb.DESCRIPTOR.name  # the same file name, in two pools
    assert xpb.DESCRIPTOR.pool is descriptor_pool.Default()
    assert pb.DESCRIPTOR.pool is not descriptor_pool.Default()


    def request(pb, base, path):
        message = pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=base.HeaderMap(
                    headers=[base.HeaderValue(key=":path", raw_value=path.encode())]
                ),
                end_of_stream=True,
            )
        )
        message.attributes["envoy.filters.http.ext_proc"]["request.path"] = path
        return message


    def response(pb, base, duration, path):
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(
                response=pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=[path]))
            ),
            override_message_timeout=duration.Duration(seconds=3, nanos=500),
        )


    # Bytes round trip, both directions, every field intact.
    for src, dst in ((a, b), (b, a)):
        sent = request(src[0], src[2], "/v1/x")
        got = dst[0].ProcessingRequest.FromString(sent.SerializeToString())
        assert got.request_headers.headers.headers[0].raw_value == b"/v1/x"
        assert got.attributes["envoy.filters.http.ext_proc"]["request.path"] == "/v1/x"
        assert src[0].ProcessingRequest.FromString(got.SerializeToString()) == sent
        answer = response(src[0], src[2], src[3], "x-y")
        back = dst[0].ProcessingResponse.FromString(answer.SerializeToString())
        assert back.override_message_timeout.ToMilliseconds() == 3000
        assert list(back.request_headers.response.header_mutation.remove_headers) == ["x-y"]


    async def call(server_side, client_side):
        spb, sg, sbase, sduration = server_side
        cpb, cg, cbase, _ = client_side

        class Echo(sg.ExternalProcessorServicer):
            async def Process(self, requests, context):
                async for message in requests:
                    path = message.request_headers.headers.headers[0].raw_value.decode()
                    yield response(spb, sbase, sduration, path)

        server = grpc.aio.server()
        sg.add_ExternalProcessorServicer_to_server(Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stream = cg.ExternalProcessorStub(channel).Process()
                await stream.write(request(cpb, cbase, "/v1/chat/completions"))
                answer = await asyncio.wait_for(stream.read(), 30)
                await stream.done_writing()
        finally:
            await server.stop(None)
        assert isinstance(answer, cpb.ProcessingResponse)
        mutation = answer.request_headers.response.header_mutation
        assert list(mutation.remove_headers) == ["/v1/chat/completions"]
        assert answer.override_message_timeout.seconds == 3


    asyncio.run(call(a, b))  # pdproc's servicer, xds-protos' client
    asyncio.run(call(b, a))  # and the other way round
    print("coexist ok")
    """
)

PURE_PYTHON = textwrap.dedent(
    """
    from google.protobuf.internal import api_implementation

    from pdproc._proto.envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
    from pdproc._proto.envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import (
        ProcessingMode,
    )
    from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from pdproc._proto.envoy.type.v3.http_status_pb2 import HttpStatus
    from pdproc._proto.google.protobuf.duration_pb2 import Duration

    assert api_implementation.Type() == "python", api_implementation.Type()
    message = pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=502),
            headers=pb.HeaderMutation(
                set_headers=[
                    HeaderValueOption(
                        header=HeaderValue(key="x-pdproc-error", raw_value=b"prefill_failed"),
                        append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                    )
                ]
            ),
            body=b"{}",
        ),
        mode_override=ProcessingMode(request_body_mode=ProcessingMode.NONE),
        override_message_timeout=Duration(seconds=61),
    )
    print(message.SerializeToString(deterministic=True).hex())
    """
)


def run(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env={**os.environ, **(env or {})},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_stubs_register_in_a_private_pool() -> None:
    assert pb.DESCRIPTOR.pool is not descriptor_pool.Default()
    assert pb.DESCRIPTOR.name == "envoy/service/ext_proc/v3/external_processor.proto"
    if "envoy.service.ext_proc.v3.external_processor_pb2" not in sys.modules:
        with pytest.raises(KeyError):
            descriptor_pool.Default().FindFileByName(pb.DESCRIPTOR.name)
        with pytest.raises(KeyError):
            descriptor_pool.Default().FindMessageTypeByName(
                "envoy.service.ext_proc.v3.ProcessingRequest"
            )
    # The name on the wire is Envoy's.
    service = pb.DESCRIPTOR.services_by_name["ExternalProcessor"]
    assert service.full_name == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert hasattr(pb_grpc, "add_ExternalProcessorServicer_to_server")


@pytest.fixture(scope="module")
def xds_protos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """xds-protos unpacked into a throwaway directory (never into the test virtualenv)."""
    target = tmp_path_factory.mktemp("xds_protos")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            XDS_PROTOS,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return target


@pytest.mark.parametrize("order", ["pdproc-first", "xds-protos-first"])
def test_stubs_coexist_with_xds_protos(xds_protos: Path, order: str) -> None:
    assert "coexist ok" in run(COEXIST, order, env={"PYTHONPATH": str(xds_protos)})


def test_stubs_work_on_the_pure_python_backend() -> None:
    pure = run(PURE_PYTHON, env={"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"})
    native = run(PURE_PYTHON.replace('== "python"', '!= "python"'))
    assert pure == native
