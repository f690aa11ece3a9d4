"""bench.opcodes' pure parts and its tracer, counting a function run here (the measuring
itself starts a simulated pair and a processor: a tool, not a CI step)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import opcode_tracer
from bench.opcodes import by_package, package_path, parse_counts, report


def test_files_are_named_from_their_package_on() -> None:
    site = "/w/.venv/lib/python3.11/site-packages/"
    assert package_path(site + "aiohttp/client.py") == "aiohttp/client.py"
    assert package_path(site + "pdproc/stream.py") == "pdproc/stream.py"
    assert package_path("/usr/lib/python3.11/asyncio/tasks.py") == "asyncio/tasks.py"
    assert package_path("/work/main/pdproc/connectors/mooncake.py") == (
        "pdproc/connectors/mooncake.py"
    )
    assert package_path("/work/main/bench/floor.py") == "bench/floor.py"
    assert package_path("<string>") == "<string>"


def test_counts_are_charged_to_pdproc_modules_and_other_packages() -> None:
    rows = [
        ["/w/pdproc/stream.py", 65, "Stream.run", 700, 70],
        ["/w/.venv/lib/python3.11/site-packages/aiohttp/client.py", 558, "_request", 3000, 20],
        ["/w/.venv/lib/python3.11/site-packages/aiohttp/streams.py", 422, "read", 600, 20],
        ["/w/pdproc/stream.py", 233, "Stream._write", 300, 60],
    ]
    counted = parse_counts(rows)
    assert [c.name for c in counted] == ["_request", "Stream.run", "read", "Stream._write"]
    assert by_package(counted) == [("aiohttp", 3600), ("pdproc/stream.py", 1000)]
    table = report(counted, streams=10, top=2)
    assert table.splitlines()[0] == "460 bytecodes per request (10 streams)"
    assert "        360   78.3%  aiohttp" in table
    assert "aiohttp/client.py:558 _request" in table
    assert "Stream._write" not in table  # past --top


@dataclass(frozen=True)
class Pair:
    a: int
    b: int


def work(n: int) -> int:
    total = 0
    for i in range(n):
        total += Pair(i, i).a
    return total


def test_the_tracer_counts_each_function_between_its_signals(tmp_path: Path) -> None:
    out = tmp_path / "counts.json"
    previous = sys.gettrace()  # (a debugger's or coverage's tracer is put back)
    try:
        opcode_tracer._start()
        work(10)
        opcode_tracer._stop(str(out))
    finally:
        sys.settrace(previous)
    counted = {c.name: c for c in parse_counts(json.loads(out.read_text()))}
    assert counted["work"].calls == 1
    assert counted["Pair.__init__"].calls == 10  # the dataclass's generated method, named
    # The loop runs its body ten times: more bytecodes than ten, fewer than a thousand.
    assert 10 < counted["work"].opcodes < 1000
    assert counted["work"].where.endswith("tests/unit/test_bench_opcodes.py")
    # Only the window is counted: nothing from before _start or after _stop.
    assert "test_the_tracer_counts_each_function_between_its_signals" not in counted
    assert "parse_counts" not in counted
