"""`python -m bench.run`: the side-by-side benchmark (see bench/README.md).

Each configuration (bench/stack.py) is a front door to a simulated vLLM P/D pair; all are
started once and kept running, and only the one being measured gets traffic. Rounds
interleave the configurations cell by cell (the order rotates every round), so slow drift
on the shared box hits every configuration alike; each number reported is the median over
rounds with its spread. Each process's CPU time is read from /proc right before and right
after the measured requests (the load generator waits for the go between its warm-up and
its measured phase) and divided by the requests completed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
from pdproc_sim import devstack

from bench import baseline, chart, profile, report
from bench.stack import (
    CONFIGS,
    DESCRIPTIONS,
    PROXY_ROLES,
    Bench,
    CpuReading,
    StackOptions,
    Target,
    bench_stack,
    cpu_delta,
    host_cpu,
    tree_cpu,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
KiB = 1024
MiB = 1024 * 1024
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

    def sim_args(self) -> tuple[str, ...]:
        return (
            *("--prefill-delay-ms", str(self.prefill_delay_ms)),
            *("--prefill-ms-per-kib", str(self.prefill_ms_per_kib)),
            *("--first-token-delay-ms", str(self.first_token_delay_ms)),
            *("--itl-ms", str(self.itl_ms)),
            *("--default-tokens", str(self.tokens)),
            # The ring keeps request bodies; the bench never reads it back.
            *("--record-limit", "256"),
        )


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
    workers: int
    pdproc_args: tuple[str, ...]
    envoy_options: dict[str, Any]
    profile_s: float
    profile_size: int
    profile_concurrency: int
    smoke: bool
    command: str
    upload_mbps: float = 0.0
    baseline_pdproc: Path | None = None
    # The configuration whose flags pdproc-baseline runs with (--baseline-like).
    baseline_like: str = "pdproc"
    # Cells whose bodies in flight (size x concurrency) pass this are left out (0: none).
    max_cell_bytes: int = 0
    # Measured requests at a given concurrency, over `requests` (--requests 16:300,...).
    requests_at: dict[int, int] = field(default_factory=dict)

    def requests_for(self, concurrency: int) -> int:
        if concurrency in self.requests_at:
            return self.requests_at[concurrency]
        # Every worker sends several, so p99 is not one request's luck; few enough that five
        # rounds of 1 KiB and 1 MiB at c = 1/16/64 for every configuration fit in 20 minutes.
        return self.requests if self.requests is not None else max(30, 6 * concurrency)

    def warmup_for(self, concurrency: int) -> int:
        # One per worker at least, so the measured requests find every connection open.
        return self.warmup if self.warmup is not None else max(2, concurrency)

    def stack(self) -> StackOptions:
        return StackOptions(
            sim_args=self.sim.sim_args(),
            envoy_concurrency=self.envoy_concurrency,
            pdproc_log_level=self.pdproc_log_level,
            workers=self.workers,
            pdproc_args=self.pdproc_args,
            envoy_options=self.envoy_options,
            # The largest body plus room for what the processors splice in.
            max_body_bytes=max(16 * MiB, max(self.sizes) + MiB),
            baseline_pdproc=self.baseline_pdproc,
            baseline_like=self.baseline_like,
        )


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


def _envoy_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError:
        parsed = value
    return key.strip(), parsed


def _requests(text: str) -> int | dict[int, int]:
    """N, or per concurrency C:N,C:N (a concurrency not listed gets the default count)."""
    if ":" not in text:
        return _positive_int(text)
    out: dict[int, int] = {}
    for item in text.split(","):
        level, sep, count = item.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected C:N, got {item!r}")
        out[_positive_int(level)] = _positive_int(count)
    return out


# Named runs: flags put before the command line's own (which, given again, win).
PRESETS: dict[str, tuple[str, ...]] = {
    # pdproc with every default of the installed wheel against the floor, the client doing
    # P/D itself and vllm-router, beside the same pdproc with one process per CPU and with
    # every body buffered: the comparison a user's own harness makes (a 20 ms prefill, the
    # first token 10 ms after the KV, 8 tokens 5 ms apart; 300 requests per round at c=16).
    "defaults": (
        "--configs",
        "floor,pdproc-defaults,pdproc-auto-workers,pdproc-buffered,direct-pd,vllm-router",
        *("--sizes", "1k,1m", "--concurrency", "1,16,64", "--rounds", "3"),
        *("--requests", "1:40,16:300,64:384", "--time-limit", "15", "--budget", "1500"),
        *("--prefill-delay-ms", "20", "--first-token-delay-ms", "10"),
        *("--itl-ms", "5", "--tokens", "8"),
        # Envoy's own default on a 2-core box (one worker thread per CPU), as a user runs it:
        # with one thread its one connection reaches one pdproc worker only.
        *("--envoy-concurrency", "2"),
    ),
}


def with_preset(argv: Sequence[str]) -> list[str]:
    """`argv` with its --preset NAME replaced by the preset's flags, put first."""
    args = list(argv)
    for i, arg in enumerate(args):
        name = arg.partition("=")[2] if arg.startswith("--preset=") else None
        if arg == "--preset" and i + 1 < len(args):
            name = args[i + 1]
            del args[i : i + 2]
        elif name is not None:
            del args[i]
        else:
            continue
        if name not in PRESETS:
            raise SystemExit(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
        return [*PRESETS[name], *args]
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="Side-by-side streaming P/D benchmark: pdproc against its floor, Envoy "
        "alone, the client doing P/D itself, vllm-router and sglang-router.",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a named run (its flags first; flags given here win): defaults = pdproc with "
        "every default against the floor, 1 KiB and 1 MiB, c=1/16/64",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="1 round, 1 KiB, concurrency 1 and 4, 10 requests, 4 tokens (< 60 s)",
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
        default=(KiB, MiB),
        help="request body sizes, e.g. 1k,64k,1m (default 1k,1m)",
    )
    parser.add_argument("--concurrency", type=_csv(_positive_int), default=(1, 16, 64))
    parser.add_argument(
        "--requests",
        type=_requests,
        default=None,
        help="measured requests per run: N, or C:N,... per concurrency (default: max(30, "
        "6 x concurrency))",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up requests per run (default: max(2, concurrency))",
    )
    parser.add_argument("--rounds", type=_positive_int, default=5)
    parser.add_argument(
        "--upload-mbps",
        type=float,
        default=0.0,
        help="clients send bodies over 64 KiB in 64 KiB pieces at this many MB/s, as over a "
        "real link (0, the default: as fast as loopback goes)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=20.0,
        help="seconds per measured run (a run stops at N requests or this)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=1200.0,
        help="overall seconds; cells not started by then are left out",
    )
    parser.add_argument("--prefill-delay-ms", type=float, default=20.0)
    parser.add_argument("--prefill-ms-per-kib", type=float, default=0.0)
    parser.add_argument("--first-token-delay-ms", type=float, default=5.0)
    parser.add_argument("--itl-ms", type=float, default=5.0)
    parser.add_argument("--tokens", type=_positive_int, default=None, help="max_tokens (16)")
    parser.add_argument(
        "--envoy-concurrency",
        type=_positive_int,
        default=1,
        help="Envoy worker threads, for every Envoy",
    )
    parser.add_argument(
        "--pdproc-log-level",
        default="info",
        help="pdproc's --log-level (info = as shipped: one line per request)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="processes of pdproc and of the floor (pdproc serve --workers); CPU is summed",
    )
    parser.add_argument(
        "--pdproc-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `pdproc serve` argument (repeatable), e.g. --pdproc-arg=--log-level=warning",
    )
    parser.add_argument(
        "--envoy-option",
        type=_envoy_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="EnvoyOptions field for pdproc's Envoys (repeatable; JSON value), e.g. "
        "hold_response=false. The floor's Envoy always runs the default envoy-config output",
    )
    parser.add_argument(
        "--profile",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="afterwards, py-spy pdproc and the floor for SECONDS each under the same load "
        "(profile.svg, profile.txt, profile-floor.txt, profile-top.txt)",
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the processes in DIR and keep their logs there (default: a temporary folder)",
    )
    parser.add_argument(
        "--baseline-pdproc",
        type=Path,
        default=None,
        metavar="PATH",
        help="another pdproc to run as pdproc-baseline, beside this one in the same rounds: "
        "its bin/pdproc, its virtualenv or a wheel (python -m bench.baseline builds one at a "
        "git revision)",
    )
    parser.add_argument(
        "--baseline-like",
        choices=("pdproc", "pdproc-defaults", "pdproc-auto-workers", "pdproc-buffered"),
        default="pdproc",
        help="the configuration whose flags pdproc-baseline runs with (default pdproc; "
        "pdproc-defaults: the baseline with every default, beside pdproc-defaults)",
    )
    parser.add_argument(
        "--max-cell-bytes",
        type=parse_size,
        default=0,
        metavar="SIZE",
        help="leave out cells whose body bytes in flight (size x concurrency) pass SIZE, e.g. "
        "512m: 16 MiB at c=64 holds 1 GiB in the simulator, which a 24 GiB box cannot keep",
    )
    parser.add_argument("--profile-size", type=parse_size, default=KiB, help="default 1k")
    parser.add_argument("--profile-concurrency", type=_positive_int, default=16)
    return parser


def options_from(args: argparse.Namespace, argv: Sequence[str]) -> Options:
    tokens = args.tokens if args.tokens is not None else (4 if args.smoke else 16)
    sim = SimTiming(
        args.prefill_delay_ms,
        args.prefill_ms_per_kib,
        args.first_token_delay_ms,
        args.itl_ms,
        tokens,
    )
    common: dict[str, Any] = {
        "out": args.out,
        "configs": tuple(dict.fromkeys(args.configs)),
        "sim": sim,
        "envoy_concurrency": args.envoy_concurrency,
        "pdproc_log_level": args.pdproc_log_level,
        "workers": args.workers,
        "pdproc_args": tuple(args.pdproc_arg),
        "envoy_options": dict(args.envoy_option),
        "upload_mbps": args.upload_mbps,
        "baseline_pdproc": args.baseline_pdproc,
        "baseline_like": args.baseline_like,
        "max_cell_bytes": args.max_cell_bytes,
        "command": shlex.join(["python", "-m", "bench.run", *argv]),
    }
    if args.smoke:
        return Options(
            **common,
            sizes=(KiB,),
            concurrency=(1, 4),
            requests=10,
            warmup=2,
            rounds=1,
            time_limit_s=10.0,
            budget_s=120.0,  # a safety net: a smoke run takes ~35 s
            profile_s=0.0,
            profile_size=KiB,
            profile_concurrency=16,
            smoke=True,
        )
    return Options(
        **common,
        sizes=tuple(args.sizes),
        concurrency=tuple(args.concurrency),
        requests=args.requests if isinstance(args.requests, int) else None,
        requests_at=args.requests if isinstance(args.requests, dict) else {},
        warmup=args.warmup,
        rounds=args.rounds,
        time_limit_s=args.time_limit,
        budget_s=args.budget,
        profile_s=args.profile,
        profile_size=args.profile_size,
        profile_concurrency=args.profile_concurrency,
        smoke=False,
    )


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
        "mean": sum(values) / len(values) if values else None,
    }


@dataclass
class Snapshot:
    """Everything read at one edge of the measured phase."""

    cpu: dict[str, CpuReading]  # role -> the CPU time of its process tree
    host: tuple[float, float]
    decode: dict[str, Any]  # the simulated decode's /sim/stats
    processing: tuple[float, float] | None  # pdproc_request_processing_seconds sum, count
    ext_proc: dict[str, int]  # Envoy's ext_proc counters (messages to and from the processor)


def _get(url: str) -> tuple[int, bytes]:
    """A GET of a stats page; a part too busy to answer in time (16 MiB prompts at c=64 keep
    the simulator busy) costs that run its figure, never the whole bench."""
    try:
        return devstack.http_get(url, timeout_s=_STATS_TIMEOUT_S)
    except OSError:
        return 0, b""


_STATS_TIMEOUT_S = 20.0


def _sim_stats(target: Target) -> dict[str, Any]:
    status, body = _get(target.sim.decode.url() + "/sim/stats")
    return orjson.loads(body) if status == 200 else {}


def _processing(target: Target) -> tuple[float, float] | None:
    if target.metrics is None:
        return None
    status, page = _get(target.metrics.url() + "/metrics")
    return scrape_processing(page.decode()) if status == 200 else None


def scrape_processing(metrics_text: str) -> tuple[float, float]:
    """pdproc_request_processing_seconds (sum, count) from a /metrics page."""
    total = count = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("pdproc_request_processing_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("pdproc_request_processing_seconds_count"):
            count += float(line.split()[-1])
    return total, count


def _ext_proc(target: Target) -> dict[str, int]:
    if target.envoy_admin is None:
        return {}
    status, body = _get(target.envoy_admin.url() + "/stats?filter=ext_proc")
    out = {}
    for line in body.decode().splitlines() if status == 200 else ():
        name, _, value = line.partition(": ")
        if name.endswith(("stream_msgs_sent", "stream_msgs_received")) and value.isdigit():
            out[name.rpartition(".")[2]] = int(value)
    return out


def snapshot(target: Target, *, before: bool) -> Snapshot:
    """Read CPU times closest to the measured phase; the HTTP reads (which cost the simulator,
    Envoy and pdproc a little CPU) happen outside the CPU bracket."""
    if before:
        processing, decode, ext_proc = _processing(target), _sim_stats(target), _ext_proc(target)
    cpu = {role: tree_cpu(pid) for role, pid in target.pids.items()}
    host = host_cpu()
    if not before:
        ext_proc, decode, processing = _ext_proc(target), _sim_stats(target), _processing(target)
    return Snapshot(cpu, host, decode, processing, ext_proc)


def measure(
    target: Target,
    size: int,
    concurrency: int,
    requests: int,
    warmup: int,
    opts: Options,
    request_timeout_s: float = 30.0,
) -> tuple[dict[str, Any], Snapshot | None, Snapshot | None]:
    """One loadgen run: warm-up, snapshot, measured phase, snapshot."""
    argv = [
        sys.executable,
        *("-m", "bench.loadgen", "--url", target.url, "--size", str(size)),
        *("--concurrency", str(concurrency), "--requests", str(requests)),
        *("--warmup", str(warmup), "--time-limit", str(opts.time_limit_s)),
        *("--request-timeout", str(request_timeout_s)),
        *("--max-tokens", str(opts.sim.tokens), "--sync"),
        *("--upload-mbps", str(opts.upload_mbps)),
        *target.loadgen_args,
    ]
    # Two phases (warm-up and measured), each bounded by the time limit, plus slack.
    timeout = 2 * opts.time_limit_s + _LOADGEN_SLACK_S
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, cwd=REPO_ROOT
        )
        assert proc.stdin is not None
        assert proc.stdout is not None
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        first = second = None
        try:
            warm = proc.stdout.readline()
            if warm:
                first = snapshot(target, before=True)
                proc.stdin.write(b"go\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                if line:
                    second = snapshot(target, before=False)
                    result: dict[str, Any] = orjson.loads(line)
            proc.stdin.close()
            code = proc.wait()
        finally:
            killer.cancel()
        if first is None or second is None:
            errors.seek(0)
            tail = errors.read()[-500:].decode("utf-8", "replace")
            killed = " (killed: time out)" if code == -9 else ""
            return {"error": f"loadgen exit {code}{killed}: {tail}"}, None, None
    return result, first, second


def run_cell(
    bench: Bench,
    target: Target,
    size: int,
    concurrency: int,
    opts: Options,
    round_no: int,
    requests: int | None = None,
    warmup: int | None = None,
    request_timeout_s: float = 30.0,
) -> dict[str, Any]:
    n = requests if requests is not None else opts.requests_for(concurrency)
    warmup = warmup if warmup is not None else opts.warmup_for(concurrency)
    started = time.time()
    raw, first, second = measure(target, size, concurrency, n, warmup, opts, request_timeout_s)
    row: dict[str, Any] = {
        "round": round_no,
        "config": target.name,
        "size": size,
        "concurrency": concurrency,
        "requests": n,
        "warmup": warmup,
        "started": started,
    }
    if "error" in raw or first is None or second is None:
        row.update(ok=0, failed=n, errors={raw.get("error", "no result"): 1})
        return row
    ok = raw["ok"]
    row.update(_load_figures(raw))
    row.update(_cpu_figures(target, raw, first, second))
    row.update(_pairing_figures(first, second), pd=target.pd)
    if first.ext_proc and second.ext_proc and ok:
        row.update(_ext_proc_messages(first, second, ok))
    if first.processing is not None and second.processing is not None:
        row["pdproc_processing_ms_mean"] = _processing_ms_mean(first.processing, second.processing)
    return row


def _load_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """What the load generator counted and timed."""
    return {
        "ok": raw["ok"],
        "failed": raw["failed"],
        "errors": raw["errors"],
        "warmup_failed": raw["warmup_failed"],
        "warmup_errors": raw["warmup_errors"],
        "sent": raw["sent"],
        "warmup_sent": raw["warmup_sent"],
        "hit_time_limit": raw["hit_time_limit"],
        "wall_s": raw["wall_s"],
        "rps": raw["rps"],
        "body_bytes": raw["body_bytes"],
        "ttft_ms": _stats(raw["ttft_ms"]),
        "e2e_ms": _stats(raw["e2e_ms"]),
    }


def _per_request_ms(seconds: float | None, ok: int) -> float | None:
    return None if seconds is None or not ok else seconds * 1000 / ok


def _proxy_total(per_req: dict[str, float | None], target: Target) -> float | None:
    """The proxy roles' CPU per request added up; None when one of them is unknown."""
    proxy = [per_req[role] for role in PROXY_ROLES if role in target.pids]
    if not proxy or any(v is None for v in proxy):
        return None
    return sum(v for v in proxy if v is not None)


def _cpu_figures(
    target: Target, raw: dict[str, Any], first: Snapshot, second: Snapshot
) -> dict[str, Any]:
    """CPU per role over the measured phase, in total and per request, and the host's load."""
    ok = raw["ok"]
    deltas = {role: cpu_delta(first.cpu[role], second.cpu[role]) for role in target.pids}
    cpu_s = {role: run for role, (run, _) in deltas.items()}
    cpu_s["client"] = raw["client_cpu_s"]
    per_req = {role: _per_request_ms(s, ok) for role, s in cpu_s.items()}
    # The same from /proc/<pid>/stat (10 ms ticks): a cross-check of the schedstat figures.
    per_req_stat = {role: _per_request_ms(s, ok) for role, (_, s) in deltas.items()}
    busy = second.host[0] - first.host[0]
    total = second.host[1] - first.host[1]
    return {
        "cpu_s": cpu_s,
        "cpu_ms_per_req": per_req,
        "cpu_ms_per_req_stat": per_req_stat,
        "proxy_cpu_ms_per_req": _proxy_total(per_req, target),
        "host_busy": busy / total if total else None,
    }


def _pairing_figures(first: Snapshot, second: Snapshot) -> dict[str, Any]:
    """Requests whose decode got its KV from a prefill, as the simulated decode counts them,
    and the KV transfers it saw fail."""
    kv_ok = second.decode.get("kv_ok", 0) - first.decode.get("kv_ok", 0)
    failures_after = sum((second.decode.get("kv_failures") or {}).values())
    failures_before = sum((first.decode.get("kv_failures") or {}).values())
    return {"paired": kv_ok, "kv_failures": failures_after - failures_before}


def _ext_proc_messages(first: Snapshot, second: Snapshot, ok: int) -> dict[str, float]:
    """Envoy -> processor (request headers, body, response headers ...) and back, per request."""
    row: dict[str, float] = {}
    for key, label in (("stream_msgs_sent", "to"), ("stream_msgs_received", "from")):
        messages = second.ext_proc.get(key, 0) - first.ext_proc.get(key, 0)
        row[f"ext_proc_msgs_{label}_processor_per_req"] = messages / ok
    return row


def _processing_ms_mean(first: tuple[float, float], second: tuple[float, float]) -> float | None:
    count = second[1] - first[1]
    spent = second[0] - first[0]
    return spent * 1000 / count if count else None


def preflight(bench: Bench, opts: Options) -> None:
    """A few plain requests per configuration; one that fails them is skipped, with the
    reason, and so is a P/D configuration whose requests do not pair on the simulator."""
    # Bounded: a configuration that hangs costs a few seconds, not the run's budget.
    quick = replace(opts, time_limit_s=2.0)
    for name, target in list(bench.targets.items()):
        row = run_cell(bench, target, KiB, 1, quick, 0, requests=2, warmup=0, request_timeout_s=5)
        reason = None
        if row["ok"] != 2:
            reason = f"preflight requests failed: {row['errors']}"
        elif target.pd and row["paired"] < 2:
            reason = f"requests succeeded but did not pair on the simulator ({row['paired']}/2)"
        if reason is not None:
            bench.skipped[name] = reason
            del bench.targets[name]


# ------------------------------------------------------------------------------ main


def loadavg() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def meta(opts: Options) -> dict[str, Any]:
    cpu_model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu_model = line.split(":", 1)[1].strip()
            break
    return {
        "command": opts.command,
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
        "workers": opts.workers,
        "pdproc_args": list(opts.pdproc_args),
        "envoy_options": opts.envoy_options,
        "upload_mbps": opts.upload_mbps,
        "baseline_pdproc": str(opts.baseline_pdproc) if opts.baseline_pdproc else None,
        "baseline_like": opts.baseline_like,
        "max_cell_bytes": opts.max_cell_bytes,
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "loadavg_start": loadavg(),
        "truncated": False,
    }


def write_outputs(results: dict[str, Any], opts: Options, final: bool) -> str:
    results["summary"] = report.summarise(results["runs"], opts)
    table = report.markdown(results)
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
        f"[round {row['round']}] {row['config']:<16} {chart.size_label(row['size']):>7} "
        f"c={row['concurrency']:<3}"
    )
    if "ttft_ms" not in row:
        return f"{head} FAILED: {row['errors']}"
    ttft = row["ttft_ms"]
    if ttft["p50"] is None:
        return f"{head} no successful request: {row['errors']}"
    cpu = row["proxy_cpu_ms_per_req"]
    return (
        f"{head} ttft p50 {ttft['p50']:7.2f} p99 {ttft['p99']:7.2f}  {row['rps']:6.1f} req/s"
        f"  proxy cpu {'  ..' if cpu is None else f'{cpu:5.2f}'} ms/req"
        f"  ok {row['ok']}/{row['sent']} paired {row['paired']}"
        f"  busy {(row['host_busy'] or 0) * 100:3.0f}%"
    )


def run(opts: Options, workdir: Path) -> dict[str, Any]:
    deadline = time.monotonic() + opts.budget_s
    results: dict[str, Any] = {"meta": meta(opts), "configs": {}, "runs": [], "summary": {}}
    started = time.monotonic()
    with bench_stack(opts.configs, opts.stack(), workdir) as bench:
        results["meta"]["startup_s"] = round(time.monotonic() - started, 2)
        preflight(bench, opts)
        results["meta"]["versions"] = bench.versions
        for name in opts.configs:
            results["configs"][name] = _config_status(bench, name)
        names = [n for n in opts.configs if n in bench.targets]
        for rnd in range(1, opts.rounds + 1):
            _run_round(bench, opts, results, _rotated(names, rnd), rnd, deadline)
            write_outputs(results, opts, final=False)
        results["meta"]["measured_s"] = round(time.monotonic() - started, 2)
        if opts.profile_s > 0:
            results["profile"] = _profile(bench, opts)
    results["meta"]["loadavg_end"] = loadavg()
    results["meta"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return results


def _config_status(bench: Bench, name: str) -> dict[str, Any]:
    """How a configuration fared at start and preflight (said on stderr when skipped)."""
    target = bench.targets.get(name)
    if not target:
        print(f"skipping {name}: {bench.skipped.get(name)}", file=sys.stderr)
    return {
        "status": "ok" if target else "skipped",
        "reason": bench.skipped.get(name),
        "description": DESCRIPTIONS[name],
        "url": target.url if target else None,
        "roles": sorted(target.pids) if target else [],
    }


def _rotated(names: list[str], rnd: int) -> list[str]:
    """Rotate the order every round so no configuration always runs first (cold) or last."""
    shift = (rnd - 1) % max(1, len(names))
    return names[shift:] + names[:shift]


def _cells(opts: Options, order: list[str]) -> Iterator[tuple[int, int, str]]:
    """One round's cells (size, concurrency, configuration), without those over
    --max-cell-bytes."""
    for size in opts.sizes:
        for level in opts.concurrency:
            if opts.max_cell_bytes and size * level > opts.max_cell_bytes:
                continue
            for name in order:
                yield size, level, name


def _run_round(
    bench: Bench,
    opts: Options,
    results: dict[str, Any],
    order: list[str],
    rnd: int,
    deadline: float,
) -> None:
    """Measure one round's cells, until the budget's deadline (then the run is truncated)."""
    for size, level, name in _cells(opts, order):
        if time.monotonic() > deadline:
            results["meta"]["truncated"] = True
            return
        row = run_cell(bench, bench.targets[name], size, level, opts, rnd)
        results["runs"].append(row)
        print(_progress(row), file=sys.stderr, flush=True)


def _profile(bench: Bench, opts: Options) -> dict[str, Any]:
    print(f"profiling for {opts.profile_s:g} s each ...", file=sys.stderr, flush=True)

    def cell(target: Target, requests: int, time_limit_s: float) -> dict[str, Any]:
        quick = replace(opts, time_limit_s=time_limit_s)
        size, level = opts.profile_size, opts.profile_concurrency
        return run_cell(bench, target, size, level, quick, 0, requests=requests)

    return profile.profile_processors(
        bench, opts.out, opts.profile_s, opts.profile_size, opts.profile_concurrency, cell
    )


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    args_list = with_preset(given)
    args = build_parser().parse_args(args_list)
    # The command as given (a preset stays its name; meta has every setting it stood for).
    opts = options_from(args, given)
    opts.out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if args.keep_logs is not None:
            workdir = args.keep_logs.resolve()
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pdproc-bench-")))
        if opts.baseline_pdproc is not None:
            opts = replace(opts, baseline_pdproc=baseline.resolve(opts.baseline_pdproc, workdir))
        try:
            results = run(opts, workdir)
        except BaseException:
            # The processes' own logs say why a start failed; they vanish with the tmp dir.
            for log in sorted(workdir.rglob("*.log")):
                tail = log.read_text("utf-8", errors="replace").splitlines()[-10:]
                print(f"--- {log.relative_to(workdir)}\n" + "\n".join(tail), file=sys.stderr)
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
