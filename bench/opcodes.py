"""Where a processor's Python goes per request: bytecodes counted by function.

bench.instructions counts all of a processor's user-space instructions; about two thirds
of pdproc's are the interpreter running Python, and callgrind cannot say which Python. This
runs the same client and simulated pair as bench.instructions (a client playing Envoy's side
of the ext_proc stream over real gRPC, 1 KiB chat bodies, concurrency 16), with the
processor under bench/opcode_tracer.py instead of valgrind: after a warm-up, every bytecode
its event loop executes for N streams (and their prefills) is counted by the function that
executed it. The count is exact and the same from run to run, so a change to one function
shows as that function's count, per request; an interpreter instruction budget of roughly
100 machine instructions per bytecode relates it to bench.instructions' totals.

    python -m bench.opcodes                       # the pdproc on PATH
    python -m bench.opcodes --floor               # bench/floor.py, to compare
    python -m bench.opcodes --pdproc /tmp/b/venv/bin/pdproc --top 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdproc_sim import devstack

from bench.instructions import (
    FLOOR,
    Subject,
    add_workload_arguments,
    drive,
    processor_argv,
    running,
)
from bench.loadgen import make_body
from pdproc.targets import HostPort

TRACER = Path(__file__).with_name("opcode_tracer.py")


@dataclass(frozen=True)
class Counted:
    """One function's bytecodes over the measured streams."""

    file: str
    line: int
    name: str
    opcodes: int
    calls: int

    @property
    def where(self) -> str:
        """The file as a package path: pdproc/stream.py, aiohttp/client.py, asyncio/tasks.py."""
        return package_path(self.file)

    @property
    def package(self) -> str:
        """What the time is charged to: a pdproc module, else the top-level package."""
        where = self.where
        return where if where.startswith("pdproc/") else where.split("/", 1)[0]


def package_path(file: str) -> str:
    """`file` from its package on: past site-packages/, the standard library's folder, or
    the checkout (pdproc/, bench/); anything else as it is (<string>, <frozen ...>)."""
    for marker in ("site-packages/", "/lib/python3"):
        if marker in file:
            tail = file.rsplit(marker, 1)[1]
            return tail if marker == "site-packages/" else tail.partition("/")[2]
    for top in ("/pdproc/", "/bench/"):
        if top in file:
            return top[1:] + file.rsplit(top, 1)[1]
    return file


def parse_counts(rows: Iterable[Sequence[object]]) -> list[Counted]:
    """opcode_tracer's rows ([file, line, name, bytecodes, calls]), most bytecodes first."""
    counted = [
        Counted(str(file), int(str(line)), str(name), int(str(n)), int(str(calls)))
        for file, line, name, n, calls in rows
    ]
    return sorted(counted, key=lambda c: -c.opcodes)


def by_package(counted: Iterable[Counted]) -> list[tuple[str, int]]:
    """Bytecodes per package (pdproc per module), most first."""
    totals: dict[str, int] = {}
    for one in counted:
        totals[one.package] = totals.get(one.package, 0) + one.opcodes
    return sorted(totals.items(), key=lambda item: -item[1])


def report(counted: list[Counted], streams: int, top: int) -> str:
    """The table: per request, by package and by function."""
    total = sum(one.opcodes for one in counted) or 1
    lines = [f"{total / streams:,.0f} bytecodes per request ({streams} streams)", ""]
    lines.append("per request   share  package")
    for name, n in by_package(counted)[:top]:
        lines.append(f"{n / streams:11,.0f}  {100 * n / total:5.1f}%  {name}")
    lines += ["", "per request   share  calls/req  function"]
    for one in counted[:top]:
        lines.append(
            f"{one.opcodes / streams:11,.0f}  {100 * one.opcodes / total:5.1f}%  "
            f"{one.calls / streams:9.1f}  {one.where}:{one.line} {one.name}"
        )
    return "\n".join(lines)


def count(subject: Subject, args: argparse.Namespace) -> list[Counted]:
    """The subject's bytecodes over `args.streams` streams, after a warm-up."""
    body = make_body(args.body_bytes, max_tokens=8)
    with tempfile.TemporaryDirectory(prefix="pdproc-opcodes-") as tmp:
        workdir = Path(tmp)
        sim = devstack.start_sim(workdir, ["--prefill-delay-ms", "20"])
        try:
            listen = HostPort("127.0.0.1", devstack.free_port())
            python, script, *rest = processor_argv(subject, sim, listen)
            out = workdir / "opcodes.json"
            argv = [python, str(TRACER), str(out), script, *rest]
            with running(subject.name, argv, listen, workdir) as pid:

                def switch(state: str) -> None:
                    os.kill(pid, signal.SIGUSR1 if state == "on" else signal.SIGUSR2)

                asyncio.run(
                    drive(str(listen), sim.prefill, body, args.streams, args.concurrency, switch)
                )
                # The tracer renames its file into place once written.
                devstack.wait_for(out.exists, "the bytecode counts", timeout_s=60.0)
            return parse_counts(json.loads(out.read_text()))
        finally:
            sim.process.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.opcodes", description=__doc__)
    parser.add_argument("--pdproc", default="pdproc", help="a pdproc executable (PATH's)")
    parser.add_argument("--floor", action="store_true", help="count bench/floor.py instead")
    add_workload_arguments(parser)
    parser.add_argument("--top", type=int, default=40, help="rows per table (40)")
    args = parser.parse_args(argv)
    subject = Subject(FLOOR, FLOOR) if args.floor else Subject("pdproc", args.pdproc)
    print(report(count(subject, args), args.streams, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
