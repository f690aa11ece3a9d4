"""Instructions per request: pdproc builds and the floor under callgrind, counted, not timed.

On a shared 2-core box the CPU time of one configuration moves 10-20 % between identical
rounds, so a change worth 5 % of pdproc's CPU cannot be seen in `bench.run` without many
rounds. The number of user-space instructions a processor executes per request barely
moves (within 0.5 % between runs): this measures that, as a second, noise-free view of
"what pdproc's own work costs".

Each processor runs alone under valgrind's callgrind (instrumentation off until the
measured window), behind no Envoy: a client in this process plays Envoy's side of the
ext_proc stream over real gRPC (request headers, a buffered body, the decode's response
headers, each answered before the next), against a real simulated P/D pair on loopback.
After a warm-up, instrumentation is switched on for N streams at concurrency C (and the
prefills they launched), then off. Kernel time (syscalls) is not counted: it is much the
same for every processor (the same gRPC messages and prefill exchanges).

    python -m bench.instructions          # the pdproc on PATH and the floor
    python -m bench.instructions --pdproc before=/tmp/b/venv/bin/pdproc --pdproc after=pdproc

Needs valgrind (Debian: `apt-get install valgrind`); ~30 s per processor.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from pdproc_sim import devstack

from bench.loadgen import make_body
from bench.stack import FLOOR_SCRIPT
from pdproc._proto.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from pdproc.targets import PREFILL_HEADER, HostPort

FLOOR = "floor"
WARMUP_STREAMS = 100


@dataclass(frozen=True)
class Subject:
    name: str
    binary: str  # a `pdproc` executable, or FLOOR for bench/floor.py


def parse_subject(text: str) -> Subject:
    """`NAME=PATH` (a pdproc executable) or a bare path, named after itself."""
    name, sep, binary = text.partition("=")
    if not sep:
        name, binary = text, text
    if not name or not binary:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return Subject(name, binary)


def callgrind_total(text: str) -> int:
    """The instructions an output file of callgrind counts: its `totals:` line (its
    `summary:` line, written before the run, says 0 when instrumentation started off)."""
    counts = [
        int(value.split()[0])
        for key, _, value in (line.partition(":") for line in text.splitlines())
        if key in ("totals", "summary") and value.strip()
    ]
    if not counts:
        raise ValueError("no totals in callgrind output")
    return max(counts)


def stream_messages(index: int, body: bytes, prefill: HostPort) -> tuple[pb.ProcessingRequest, ...]:
    """What Envoy sends for one P/D request in two-message mode, in order."""
    values = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        ":authority": "gateway",
        ":scheme": "http",
        "content-type": "application/json",
        "content-length": str(len(body)),
        "x-request-id": f"instr-{index}",
        PREFILL_HEADER: str(prefill),
    }
    header_list = [HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    status = [HeaderValue(key=":status", raw_value=b"200")]
    return (
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=HeaderMap(headers=header_list))
        ),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=HeaderMap(headers=status))),
    )


async def drive(
    target: str,
    prefill: HostPort,
    body: bytes,
    streams: int,
    concurrency: int,
    switch: Callable[[str], None],
) -> None:
    """Warm up, `switch("on")`, run `streams` streams, let their prefills end,
    `switch("off")` (callgrind's instrumentation, or bench.opcodes' counter)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def one(index: int) -> None:
            call = stub.Process()
            for message in stream_messages(index, body, prefill):
                await call.write(message)
                await call.read()
            await call.done_writing()
            await call.read()

        gate = asyncio.Semaphore(concurrency)

        async def gated(index: int) -> None:
            async with gate:
                await one(index)

        for index in range(WARMUP_STREAMS):
            await one(index)
        await asyncio.sleep(1.0)  # the warm-up's prefills end outside the window
        switch("on")
        try:
            await asyncio.gather(*(gated(WARMUP_STREAMS + i) for i in range(streams)))
            await asyncio.sleep(1.0)  # the measured streams' prefills end inside it
        finally:
            switch("off")


def _callgrind_control(state: str, pid: int) -> None:
    """Switch callgrind's instrumentation (callgrind_control exits 0 even when it found no
    such run: its output says so)."""
    done = subprocess.run(
        ["callgrind_control", "--instr=" + state, str(pid)], capture_output=True, text=True
    )
    if done.returncode != 0 or "Error" in done.stdout + done.stderr:
        raise RuntimeError(f"callgrind_control --instr={state} {pid}: {done.stdout}{done.stderr}")


def processor_argv(subject: Subject, sim: devstack.SimPair, listen: HostPort) -> list[str]:
    """The subject's command line: an interpreter, a script, its arguments (valgrind and
    bench.opcodes' tracer both go between the interpreter and the script's arguments)."""
    if subject.binary == FLOOR:
        argv = [sys.executable, str(FLOOR_SCRIPT), "--listen", str(listen)]
        return [*argv, "--bootstrap-port", str(sim.bootstrap.port)]
    metrics = HostPort("127.0.0.1", devstack.free_port())
    argv = [*_python_of(subject.binary), "serve", "--listen", str(listen)]
    argv += ["--metrics-listen", str(metrics), "--workers", "1"]
    argv += ["--prefill-allow", "127.0.0.1/32"]
    argv += ["--mooncake-bootstrap-port", str(sim.bootstrap.port)]
    # Measured, a prefill takes ~50x longer: no timeout or connection bound may end one
    # inside the window.
    return [*argv, "--prefill-timeout", "600", "--max-named-host-connections", "1024"]


@contextlib.contextmanager
def running(name: str, argv: list[str], listen: HostPort, workdir: Path) -> Iterator[int]:
    """`argv` started, its gRPC port open; yields its pid, stops it on exit."""
    proc = devstack.spawn(name, argv, workdir)
    try:
        devstack.wait_for(
            lambda: devstack.port_open(listen.host, listen.port),
            name,
            timeout_s=300.0,
            proc=proc,
        )
        time.sleep(1.0)  # a listening port comes before the health checker is set
        yield proc.popen.pid
    finally:
        proc.stop(timeout_s=60.0)


@contextlib.contextmanager
def processor(
    subject: Subject, workdir: Path, sim: devstack.SimPair
) -> Iterator[tuple[str, int, Path]]:
    """The subject under callgrind, ready: its gRPC address, pid and output file prefix."""
    listen = HostPort("127.0.0.1", devstack.free_port())
    out = workdir / f"callgrind.{subject.name}"
    valgrind = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
    ]
    argv = processor_argv(subject, sim, listen)
    with running(subject.name, [*valgrind, *argv], listen, workdir) as pid:
        yield str(listen), pid, out


def _python_of(binary: str) -> list[str]:
    """The interpreter and script of a console-script executable: valgrind must run the
    interpreter itself (the script's #! line is not followed)."""
    # A bare name is looked up on PATH, then beside this interpreter (its virtualenv).
    found = shutil.which(binary) or shutil.which(binary, path=str(Path(sys.executable).parent))
    path = str(Path(found or binary).resolve())
    first = Path(path).read_bytes().split(b"\n", 1)[0]
    if first.startswith(b"#!"):
        return [first[2:].decode().strip(), path]
    return [path]


def measure(subject: Subject, sim: devstack.SimPair, args: argparse.Namespace) -> float:
    """Instructions per stream (millions)."""
    streams: int = args.streams
    body = make_body(args.body_bytes, max_tokens=8)
    with tempfile.TemporaryDirectory(prefix="pdproc-instr-") as tmp:
        workdir = Path(tmp)
        with processor(subject, workdir, sim) as (target, pid, out):
            switch = functools.partial(_callgrind_control, pid=pid)
            asyncio.run(drive(target, sim.prefill, body, streams, args.concurrency, switch))
        total = sum(callgrind_total(path.read_text()) for path in workdir.glob(out.name + "*"))
    return total / streams / 1e6


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """What is measured: --streams, --concurrency, --body-bytes (bench.opcodes too)."""
    parser.add_argument("--streams", type=int, default=300, help="measured streams (300)")
    parser.add_argument("--concurrency", type=int, default=16, help="streams at once (16)")
    parser.add_argument("--body-bytes", type=int, default=1024, help="chat body size (1024)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    parser.add_argument(
        "--pdproc",
        type=parse_subject,
        action="append",
        help="NAME=PATH of a pdproc executable (repeatable; default: pdproc on PATH)",
    )
    parser.add_argument("--no-floor", action="store_true", help="leave the floor out")
    add_workload_arguments(parser)
    parser.add_argument("--rounds", type=int, default=1, help="measurements per subject (1)")
    args = parser.parse_args(argv)
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"{tool} not found: apt-get install valgrind", file=sys.stderr)
            return 2
    subjects = list(args.pdproc or [Subject("pdproc", "pdproc")])
    if not args.no_floor:
        subjects.append(Subject(FLOOR, FLOOR))
    results: dict[str, list[float]] = {subject.name: [] for subject in subjects}
    with tempfile.TemporaryDirectory(prefix="pdproc-instr-sim-") as tmp:
        sim = devstack.start_sim(Path(tmp), ["--prefill-delay-ms", "20"])
        try:
            for _ in range(args.rounds):
                for subject in subjects:
                    value = measure(subject, sim, args)
                    results[subject.name].append(value)
                    print(f"{subject.name}: {value:.3f} M instructions per request", flush=True)
        finally:
            sim.process.stop()
    floor = results.get(FLOOR)
    print(f"\n{args.streams} streams at concurrency {args.concurrency}, {args.body_bytes} B bodies")
    for name, values in results.items():
        best = statistics.median(values)
        ratio = (
            f"  {best / statistics.median(floor):.2f}x the floor" if floor and name != FLOOR else ""
        )
        spread = f" [{min(values):.3f}..{max(values):.3f}]" if len(values) > 1 else ""
        print(f"  {name:<20} {best:.3f} M{spread}{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
