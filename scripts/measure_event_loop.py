"""CPU per ext_proc stream of a grpc.aio server on uvloop and on asyncio's own loop.

A minimal servicer (three messages per stream, each answered at once) runs in a process of
its own; a client in this process drives 3,000 streams at concurrency 16 after a warm-up,
and the server's CPU time (/proc/<pid>/stat) is divided by the streams. Run:

    .venv/bin/python scripts/measure_event_loop.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys

SERVER = """
import asyncio, sys, grpc, uvloop
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
ANSWER = pb.ProcessingResponse(request_body=pb.BodyResponse())
class Answer(pb_grpc.ExternalProcessorServicer):
    async def Process(self, requests, context):
        while (await context.read()) is not grpc.aio.EOF:
            await context.write(ANSWER)
async def main():
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Answer(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()
(uvloop.run if sys.argv[1] == "uvloop" else asyncio.run)(main())
"""


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(port: int, pid: int, streams: int) -> float:
    import grpc

    from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    stub = pb_grpc.ExternalProcessorStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
    request = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * 1024, end_of_stream=True))
    limit = asyncio.Semaphore(16)

    async def one() -> None:
        async with limit:
            call = stub.Process()
            for _ in range(3):
                await call.write(request)
                await call.read()
            await call.done_writing()
            await call.read()

    await asyncio.gather(*(one() for _ in range(300)))  # warm-up
    before = cpu_seconds(pid)
    await asyncio.gather(*(one() for _ in range(streams)))
    return (cpu_seconds(pid) - before) / streams * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=3000)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"uvloop": [], "asyncio": []}
    for _ in range(args.rounds):
        for loop in results:  # interleaved, so drift on a shared machine hits both
            server = subprocess.Popen([sys.executable, "-c", SERVER, loop], stdout=subprocess.PIPE)
            try:
                assert server.stdout is not None
                port = int(server.stdout.readline())
                results[loop].append(asyncio.run(drive(port, server.pid, args.streams)))
            finally:
                server.kill()
                server.wait()
    for loop, values in results.items():
        shown = ", ".join(f"{v:.3f}" for v in values)
        print(f"{loop}: server CPU ms per stream (3 messages): {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
