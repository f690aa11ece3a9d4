"""CPU per ext_proc stream of a grpc.aio server: event loops, and ways of answering.

A minimal servicer (three messages per stream) runs in a process of its own; a client in this
process drives 3,000 streams at concurrency 16 after a warm-up, and the server's CPU time
(/proc/<pid>/stat) is divided by the streams. Variants, interleaved round by round:

- `uvloop`, `asyncio`: the event loop (`context.read()` / `context.write()`, answered at once);
- `yield`: answers yielded from `async for` over the request iterator (the floor's style);
- `held`: the third answer written 2 ms later from a task of its own while the handler reads
  on (pdproc's hold), against `held-inline`, the same wait awaited in the handler.

Run:

    .venv/bin/python scripts/measure_event_loop.py --rounds 3
    .venv/bin/python scripts/measure_event_loop.py --variants uvloop,yield,held,held-inline
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
VARIANT = sys.argv[1]
class Answer(pb_grpc.ExternalProcessorServicer):
    async def Process(self, requests, context):
        if VARIANT == "yield":
            async for _ in requests:
                yield ANSWER
            return
        pending, seen = set(), 0
        while (await context.read()) is not grpc.aio.EOF:
            seen += 1
            if seen < 3 or VARIANT in ("uvloop", "asyncio"):
                await context.write(ANSWER)
            elif VARIANT == "held-inline":
                await asyncio.sleep(0.002)
                await context.write(ANSWER)
            else:
                async def later():
                    await asyncio.sleep(0.002)
                    await context.write(ANSWER)
                task = asyncio.get_running_loop().create_task(later())
                pending.add(task)
                task.add_done_callback(pending.discard)
async def main():
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Answer(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()
(asyncio.run if VARIANT == "asyncio" else uvloop.run)(main())
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
    parser.add_argument("--variants", default="uvloop,asyncio", help="comma list (see above)")
    args = parser.parse_args()
    results: dict[str, list[float]] = {name: [] for name in args.variants.split(",")}
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
    for variant, values in results.items():
        shown = ", ".join(f"{v:.3f}" for v in values)
        print(f"{variant}: server CPU ms per stream (3 messages): {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
