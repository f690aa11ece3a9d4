"""`--profile`: py-spy on pdproc and on the floor under the same load, and where pdproc's CPU
goes beyond the floor's.

Each processor gets the same cell (1 KiB, c=16 by default) while py-spy samples it
(`--nonblocking`: the process is never paused). Per-thread CPU comes from /proc (exact);
py-spy's samples (idle excluded) are grouped by component (gRPC, protobuf, aiohttp,
logging, pdproc's own modules ...) by the file of the innermost frame, and each component's
share is scaled to the CPU per request of the threads py-spy sees (everything but threads
that never run Python code), so the two processes can be compared in ms per request.
"""

from __future__ import annotations

import linecache
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import chart
from bench.stack import MAIN_THREAD, OTHER_PYTHON_THREADS, Bench, Target, thread_cpu

Cell = Callable[[Target, int, float], dict[str, Any]]
PYTHON_THREADS = (MAIN_THREAD, OTHER_PYTHON_THREADS)

# Innermost-frame file fragments -> component, first match wins (py-spy shortens paths to
# what follows the sys.path entry, e.g. `pdproc/stream.py`, `asyncio/runners.py`).
COMPONENTS = (
    ("/grpc/", "gRPC (grpc.aio Python)"),
    ("/grpc_health/", "gRPC (grpc.aio Python)"),
    ("/google/protobuf/", "protobuf"),
    ("/_proto/", "protobuf"),
    ("/aiohttp/", "aiohttp (prefill, bootstrap)"),
    ("/multidict/", "aiohttp (prefill, bootstrap)"),
    ("/yarl/", "aiohttp (prefill, bootstrap)"),
    ("/logging/", "logging"),
    ("/pdproc/logs.py", "logging"),
    ("/prometheus_client/", "prometheus_client (metrics)"),
    ("/opentelemetry/", "opentelemetry (tracing)"),
    ("/asyncio/", "asyncio (Python parts)"),
    ("/uvloop/", "asyncio (Python parts)"),
    ("/cachetools/", "cachetools (engine cache)"),
    ("/bench/floor.py", "floor.py"),
    ("/pdproc/", "pdproc: "),
    ("/uuid.py", "uuid"),
)
# Lines where the Python frame is only waiting on C code (grpc.aio's Cython core, uvloop):
# the sample is that C code's, not the Python line's.
GRPC_LINES = ("context.write(", "context.read(", "async for request in requests")
EVENT_LOOP = "event loop C code (uvloop; grpc.aio and aiohttp callbacks)"
POLLER = "gRPC poller thread (Cython, polls grpc's completion queue)"
ROOTS = [Path(__file__).resolve().parent.parent, *(Path(p) for p in sys.path if p)]


def _source_line(path: str, line: str) -> str:
    if not line.isdigit():
        return ""
    for root in ROOTS:
        full = root / path
        if full.is_file():
            return linecache.getline(str(full), int(line))
    return ""


def component(frame: str) -> str:
    """`function (path/file.py:line)` -> the component its CPU belongs to."""
    function, _, location = frame.rstrip(")").rpartition(" (")
    path, _, line = location.partition(":")
    if function == "Runner.run":
        return EVENT_LOOP
    if function == "Thread.run" and path.endswith("threading.py"):
        return POLLER
    if any(mark in _source_line(path, line) for mark in GRPC_LINES):
        return "gRPC stream read/write (Cython, awaited from Python)"
    slashed = "/" + path
    for fragment, name in COMPONENTS:
        if fragment in slashed:
            if name.endswith(": "):  # one row per pdproc module
                return name + slashed.rpartition("/pdproc/")[2]
            return name
    if "site-packages/" in path:
        return path.split("site-packages/")[1].split("/")[0]
    return "Python stdlib: " + Path(path).stem if path.endswith(".py") else "other: " + path


def collapsed_shares(text: str) -> tuple[int, dict[str, float], list[tuple[str, float]]]:
    """py-spy raw output -> (samples, share per component, top self frames with shares)."""
    by_component: dict[str, int] = {}
    by_frame: dict[str, int] = {}
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if not f.startswith("process ")]
        if not frames:
            continue
        total += count
        leaf = frames[-1]
        name = component(leaf)
        by_component[name] = by_component.get(name, 0) + count
        by_frame[leaf] = by_frame.get(leaf, 0) + count
    if not total:
        return 0, {}, []
    shares = {name: n / total for name, n in by_component.items()}
    top = sorted(by_frame.items(), key=lambda kv: -kv[1])[:15]
    return total, shares, [(frame, n / total) for frame, n in top]


def py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def profile_one(
    binary: str, target: Target, out: Path, name: str, fmt: str, seconds: float, cell: Cell
) -> dict[str, Any]:
    """One py-spy pass over the processor during one load run."""
    pid = target.pids["processor"]
    duration = max(3, int(seconds))
    argv = [
        binary,
        *("record", "--pid", str(pid), "--duration", str(duration), "--rate", "250"),
        *("--nonblocking", "--subprocesses", "--format", fmt, "-o", str(out / name)),
    ]
    spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # attach before the load starts
    threads_before = thread_cpu(pid)
    row = cell(target, 1_000_000, float(duration - 2))
    threads_after = thread_cpu(pid)
    try:
        _, err = spy.communicate(timeout=duration + 30)
    except subprocess.TimeoutExpired:
        spy.kill()
        _, err = spy.communicate()
    result: dict[str, Any] = {"file": name, "row": row}
    if spy.returncode != 0:
        result["error"] = f"py-spy failed ({spy.returncode}): {err.decode()[-300:]}"
    ok = row.get("ok") or 0
    result["thread_cpu_ms_per_req"] = {
        thread: (threads_after.get(thread, 0.0) - spent) * 1000 / ok
        for thread, spent in threads_before.items()
        if ok and threads_after.get(thread, 0.0) - spent > 0.005
    }
    return result


def profile_processors(
    bench: Bench, out: Path, seconds: float, size: int, concurrency: int, cell: Cell
) -> dict[str, Any]:
    binary = py_spy()
    wanted = [name for name in ("pdproc", "floor") if name in bench.targets]
    prof: dict[str, Any] = {"duration_s": max(3, int(seconds)), "size": size}
    prof["concurrency"] = concurrency
    if binary is None or not wanted:
        prof["skipped"] = "py-spy not installed" if binary is None else "no pdproc or floor"
        return prof
    for name in wanted:
        target = bench.targets[name]
        suffix = "" if name == "pdproc" else f"-{name}"
        if name == "pdproc":
            svg = profile_one(binary, target, out, "profile.svg", "flamegraph", seconds, cell)
            prof["flamegraph"] = svg.get("error") or "profile.svg"
        raw = profile_one(binary, target, out, f"profile{suffix}.txt", "raw", seconds, cell)
        entry = _summarise(raw, out)
        prof[name] = entry
    if "pdproc" in prof and "floor" in prof:
        prof["compare"] = _compare(prof["pdproc"], prof["floor"])
    (out / "profile-top.txt").write_text(profile_text(prof), "utf-8")
    return prof


def _summarise(raw: dict[str, Any], out: Path) -> dict[str, Any]:
    row = raw["row"]
    entry: dict[str, Any] = {
        "file": raw["file"],
        "error": raw.get("error"),
        "run": {k: row.get(k) for k in ("ok", "failed", "rps", "ttft_ms", "cpu_ms_per_req")},
        "thread_cpu_ms_per_req": raw["thread_cpu_ms_per_req"],
    }
    path = out / raw["file"]
    if raw.get("error") or not path.exists():
        return entry
    samples, shares, top = collapsed_shares(path.read_text())
    threads = raw["thread_cpu_ms_per_req"]
    # py-spy samples the threads that run Python code; gRPC core's own threads (which name
    # themselves, e.g. event_engine) never do.
    sampled_ms = sum(ms for name, ms in threads.items() if name in PYTHON_THREADS)
    entry.update(
        samples=samples,
        sampled_threads_cpu_ms_per_req=sampled_ms,
        component_share=shares,
        component_ms_per_req={name: share * sampled_ms for name, share in shares.items()},
        top_self_frames=[{"frame": f, "share": s} for f, s in top],
    )
    return entry


def _compare(pdproc: dict[str, Any], floor: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for key, prefix in (("thread_cpu_ms_per_req", "thread "), ("component_ms_per_req", "")):
        mine, theirs = pdproc.get(key) or {}, floor.get(key) or {}
        for name in mine.keys() | theirs.keys():
            rows.append(
                {
                    "what": prefix + name,
                    "kind": "thread" if prefix else "component",
                    "pdproc": mine.get(name, 0.0),
                    "floor": theirs.get(name, 0.0),
                }
            )
    # Threads first (they add up to the process), then components, largest excess first.
    rows.sort(key=lambda r: (r["kind"] != "thread", -(r["pdproc"] - r["floor"])))
    return rows


def profile_text(prof: dict[str, Any]) -> str:
    lines = [
        f"py-spy, {chart.size_label(prof['size'])} c={prof['concurrency']}, "
        f"{prof['duration_s']} s per processor (idle excluded)",
    ]
    for name in ("pdproc", "floor"):
        entry = prof.get(name)
        if not entry:
            continue
        run = entry["run"]
        lines += [
            "",
            f"== {name}: {run['ok']} requests, {run['rps'] or 0:.0f} req/s, "
            f"{entry.get('samples', 0)} samples",
            "CPU ms per request by thread:",
        ]
        for thread, ms in sorted(entry["thread_cpu_ms_per_req"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {ms:8.3f}  {thread}")
        lines.append("By component (share of samples, ms per request):")
        shares = entry.get("component_share") or {}
        per_req = entry.get("component_ms_per_req") or {}
        for comp, share in sorted(shares.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {share * 100:5.1f}%  {per_req[comp]:7.3f}  {comp}")
        lines.append("Top frames (self):")
        for item in entry.get("top_self_frames") or []:
            lines.append(f"  {item['share'] * 100:5.1f}%  {item['frame']}")
    if prof.get("compare"):
        lines += ["", "== pdproc - floor, ms per request:"]
        for row in prof["compare"]:
            diff = row["pdproc"] - row["floor"]
            lines.append(
                f"  {diff:+8.3f}  ({row['pdproc']:.3f} vs {row['floor']:.3f})  {row['what']}"
            )
    return "\n".join(lines) + "\n"
