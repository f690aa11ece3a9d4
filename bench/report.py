"""From measured rows to numbers: per-cell spreads, same-round comparisons, the issue's
targets, and the Markdown report (summary.md)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bench import chart
from bench.stack import CONFIGS, ROLES

if TYPE_CHECKING:
    from bench.run import Options

KiB = 1024
MiB = 1024 * 1024
CPU_ROLES = (*ROLES, "client")
# Same-round comparisons: (candidate, reference). pdproc against the floor first.
VERSUS = (
    ("pdproc", "floor"),
    ("pdproc-baseline", "floor"),
    ("pdproc", "pdproc-baseline"),
    ("pdproc-defaults", "pdproc-baseline"),
    ("pdproc-auto-workers", "pdproc"),
    ("pdproc-defaults", "floor"),
    ("pdproc-defaults", "pdproc"),
    ("pdproc-buffered", "pdproc"),
    ("pdproc-nohold", "pdproc"),
    ("pdproc-nohold", "floor"),
    ("pdproc-buffered", "floor"),
    ("pdproc-auto-workers", "floor"),
    ("pdproc-defaults", "direct-pd"),
    ("floor", "direct-pd"),
    ("pdproc-defaults", "vllm-router"),
    ("pdproc-1msg", "floor"),
    ("floor", "envoy"),
    ("pdproc", "vllm-router"),
    ("floor", "vllm-router"),
    ("pdproc-nixlv2", "vllm-router-nixl"),
    ("pdproc-sglang", "sglang-router"),
)


# ------------------------------------------------------------------------- spreads


def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    """Median, min/max and quartiles over rounds (quartiles need 4+ rounds to mean much)."""
    present = sorted(v for v in values if v is not None)
    if not present:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "n": 0}
    q1 = q3 = None
    if len(present) >= 2:
        q1, _, q3 = statistics.quantiles(present, n=4, method="inclusive")
    return {
        "median": statistics.median(present),
        "min": present[0],
        "max": present[-1],
        "q1": q1,
        "q3": q3,
        "n": len(present),
    }


def metric(row: dict[str, Any] | None, name: str) -> float | None:
    """A row's scalar by summary name, e.g. ttft_p50_ms, rps or cpu_envoy_ms."""
    if row is None or "ttft_ms" not in row:
        return None
    cpu = row["cpu_ms_per_req"]
    table: dict[str, Any] = {
        "ttft_p50_ms": row["ttft_ms"]["p50"],
        "ttft_p99_ms": row["ttft_ms"]["p99"],
        "e2e_p50_ms": row["e2e_ms"]["p50"],
        "e2e_p99_ms": row["e2e_ms"]["p99"],
        "rps": row["rps"],
        "proxy_cpu_ms": row["proxy_cpu_ms_per_req"],
        **{f"cpu_{role}_ms": cpu.get(role) for role in CPU_ROLES},
        **{f"cpu_{role}_ms_stat": row["cpu_ms_per_req_stat"].get(role) for role in ROLES},
        "host_busy": row["host_busy"],
        "paired_share": row["paired"] / row["ok"] if row["pd"] and row["ok"] else None,
        "pdproc_processing_ms_mean": row.get("pdproc_processing_ms_mean"),
        "ext_proc_msgs_per_req": _msgs(row),
    }
    value = table.get(name)
    return None if value is None else float(value)


def _msgs(row: dict[str, Any]) -> float | None:
    """ext_proc messages per request, both directions (Envoy's counters)."""
    to = row.get("ext_proc_msgs_to_processor_per_req")
    back = row.get("ext_proc_msgs_from_processor_per_req")
    return None if to is None or back is None else to + back


CELL_METRICS = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "rps",
    "proxy_cpu_ms",
    *(f"cpu_{role}_ms" for role in CPU_ROLES),
    *(f"cpu_{role}_ms_stat" for role in ROLES),
    "host_busy",
    "paired_share",
    "pdproc_processing_ms_mean",
    "ext_proc_msgs_per_req",
)

Rows = dict[tuple[str, int, int, int], dict[str, Any]]


def _paired(
    rows: Rows, a: str, b: str, size: int, level: int, name: str
) -> list[tuple[float, float]]:
    """(a, b) values of one metric per round, so each pair was measured on the same box state."""
    rounds = sorted({key[3] for key in rows if key[0] == a and key[1:3] == (size, level)})
    out = []
    for rnd in rounds:
        va = metric(rows.get((a, size, level, rnd)), name)
        vb = metric(rows.get((b, size, level, rnd)), name)
        if va is not None and vb is not None:
            out.append((va, vb))
    return out


def summarise(rows: list[dict[str, Any]], opts: Options) -> dict[str, Any]:
    cells = _cells(rows)
    index = {(r["config"], r["size"], r["concurrency"], r["round"]): r for r in rows}
    versus = [
        _versus(index, a, b, size, level)
        for a, b in VERSUS
        for size in opts.sizes
        for level in opts.concurrency
        if _measured(index, a, size, level) and _measured(index, b, size, level)
    ]
    derived = [
        _derive(index, size, level, opts) for size in opts.sizes for level in opts.concurrency
    ]
    summary: dict[str, Any] = {"cells": cells, "versus": versus, "derived": derived}
    summary["headline"] = headline(versus, opts)
    summary["targets"] = judge(derived, opts, versus)
    return summary


def _measured(rows: Rows, config: str, size: int, level: int) -> bool:
    return any(key[:3] == (config, size, level) for key in rows)


def _cells(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per (config, size, concurrency) over the measured rounds (not preflight)."""
    by_cell: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for row in rows:
        if row["round"] > 0:
            by_cell.setdefault((row["config"], row["size"], row["concurrency"]), []).append(row)
    return [_cell(config, size, level, group) for (config, size, level), group in by_cell.items()]


def _cell(config: str, size: int, level: int, group: list[dict[str, Any]]) -> dict[str, Any]:
    cell: dict[str, Any] = {
        "config": config,
        "size": size,
        "concurrency": level,
        "rounds": len(group),
        "ok": sum(r.get("ok", 0) for r in group),
        "failed": sum(r.get("failed", 0) for r in group),
        "paired": sum(r.get("paired", 0) for r in group),
    }
    for name in CELL_METRICS:
        cell[name] = spread([metric(r, name) for r in group])
    return cell


def _versus(rows: Rows, a: str, b: str, size: int, level: int) -> dict[str, Any]:
    """a against b, round by round: differences for latency, ratios for throughput and CPU."""
    out: dict[str, Any] = {"a": a, "b": b, "size": size, "concurrency": level}
    for q in ("p50", "p99"):
        pairs = _paired(rows, a, b, size, level, f"ttft_{q}_ms")
        out[f"ttft_{q}_diff_ms"] = spread([x - y for x, y in pairs])
    pairs = _paired(rows, a, b, size, level, "rps")
    out["rps_ratio"] = spread([x / y for x, y in pairs if y])
    pairs = _paired(rows, a, b, size, level, "proxy_cpu_ms")
    out["proxy_cpu_ratio"] = spread([x / y for x, y in pairs if y])
    out["proxy_cpu_diff_ms"] = spread([x - y for x, y in pairs])
    for role in ("processor", "envoy"):
        pairs = _paired(rows, a, b, size, level, f"cpu_{role}_ms")
        out[f"{role}_cpu_ratio"] = spread([x / y for x, y in pairs if y])
    return out


def headline(versus: list[dict[str, Any]], opts: Options) -> dict[str, Any]:
    """The numbers issue #12 asks for: pdproc (and its single-message mode) against the floor:
    throughput at saturation with 1 KiB, and per size at c=16, TTFT p50 and CPU per request."""
    index = {(v["a"], v["b"], v["size"], v["concurrency"]): v for v in versus}
    top = max(opts.concurrency)
    mid = 16 if 16 in opts.concurrency else top
    out: dict[str, Any] = {"saturation_concurrency": top, "ttft_concurrency": mid}
    for a in ("pdproc", "pdproc-baseline", "pdproc-1msg"):
        saturation = index.get((a, "floor", KiB, top))
        per_size = []
        for size in opts.sizes:
            cell = index.get((a, "floor", size, mid))
            if cell is not None:
                keep = ("ttft_p50_diff_ms", "proxy_cpu_ratio", "processor_cpu_ratio")
                per_size.append({"size": size, **{k: cell[k] for k in keep}})
        out[a] = {
            "rps_ratio_1k_saturation": saturation["rps_ratio"] if saturation else None,
            "by_size": per_size,
        }
    return out


# --------------------------------------------------- against Envoy alone and the targets


def _derive(rows: Rows, size: int, level: int, opts: Options) -> dict[str, Any]:
    prefill_ms = opts.sim.prefill_compute_ms(size)
    out: dict[str, Any] = {"size": size, "concurrency": level, "prefill_compute_ms": prefill_ms}
    for q in ("p50", "p99"):
        out.update(_added_ttft(rows, size, level, q, prefill_ms))
    for other, key in (
        ("envoy", "throughput_ratio_pdproc_envoy"),
        ("direct-pd", "throughput_ratio_pdproc_direct_pd"),
    ):
        pairs = _paired(rows, "pdproc", other, size, level, "rps")
        out[key] = spread([p / o for p, o in pairs if o])
    return out


def _added_ttft(rows: Rows, size: int, level: int, q: str, prefill_ms: float) -> dict[str, Any]:
    """What pdproc adds to TTFT quantile `q` over Envoy alone, also net of the prefill's
    compute and of the P/D floor, and against vllm-router."""
    name = f"ttft_{q}_ms"
    added = _round_differences(rows, ("pdproc", "envoy"), size, level, name)
    floor = _round_differences(rows, ("direct-pd", "direct"), size, level, name)
    pairs = _paired(rows, "pdproc", "vllm-router", size, level, name)
    return {
        f"added_ttft_{q}_ms": spread(list(added.values())),
        # Any P/D path waits for the prefill's compute; subtracting it leaves transport + proxy.
        f"added_ttft_{q}_net_prefill_ms": spread([a - prefill_ms for a in added.values()]),
        # What P/D costs with no proxy at all (direct-pd over direct): a perfect router's floor.
        f"pd_floor_ttft_{q}_ms": spread(list(floor.values())),
        f"added_ttft_{q}_net_pd_floor_ms": spread(
            [added[rnd] - floor[rnd] for rnd in added if rnd in floor]
        ),
        f"pdproc_minus_router_ttft_{q}_ms": spread([p - r for p, r in pairs]),
    }


def _round_differences(
    rows: Rows, configs: tuple[str, str], size: int, level: int, name: str
) -> dict[int, float]:
    """Per round that pdproc ran: metric `name` of configs[0] minus configs[1], where both
    have it."""
    first, second = configs
    rounds = sorted({k[3] for k in rows if k[:3] == ("pdproc", size, level)})
    out: dict[int, float] = {}
    for rnd in rounds:
        x = metric(rows.get((first, size, level, rnd)), name)
        y = metric(rows.get((second, size, level, rnd)), name)
        if x is not None and y is not None:
            out[rnd] = x - y
    return out


def judge(
    derived: list[dict[str, Any]], opts: Options, versus: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The issues' targets, each judged on the median over rounds; met=None: not measured.

    The literal reading (pdproc minus Envoy alone) charges pdproc with the prefill itself,
    which no P/D router can avoid, so each latency target is also judged net of the P/D floor
    (direct-pd minus direct) and net of the simulated prefill time.
    """
    verdicts: list[dict[str, Any]] = []
    index = {(d["size"], d["concurrency"]): d for d in derived}

    def check(target: str, size: int, level: int, key: str, limit: float, op: str) -> None:
        verdicts.append(_verdict(index.get((size, level)), target, size, level, key, limit, op))

    _latency_targets(check, opts)
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
    verdicts += _long_prompt_targets(versus or [], opts)
    return verdicts


def _verdict(
    cell: dict[str, Any] | None,
    target: str,
    size: int,
    level: int,
    key: str,
    limit: float,
    op: str,
) -> dict[str, Any]:
    value = cell[key]["median"] if cell and cell.get(key) else None
    met = None
    if value is not None:
        met = {"<=": value <= limit, "<": value < limit, ">=": value >= limit}[op]
    return {
        "target": target,
        "size": size,
        "concurrency": level,
        "metric": key,
        "op": op,
        "limit": limit,
        "value": value,
        "met": met,
    }


def _latency_targets(check: Any, opts: Options) -> None:
    """Issue 12's: added TTFT at 1 KiB and 1 MiB, throughput against Envoy alone."""
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


def _long_prompt_targets(versus: list[dict[str, Any]], opts: Options) -> list[dict[str, Any]]:
    """Issue 22's, from same-round pairs: at 1 MiB and more, pdproc's CPU per request at most
    the floor's, its throughput at saturation and TTFT p50 at c=16 at least as good; at
    4 MiB and more, TTFT p50 at c=1 at most vllm-router's."""
    index = {(v["a"], v["b"], v["size"], v["concurrency"]): v for v in versus}
    top = max(opts.concurrency)
    out = []
    for size in (s for s in opts.sizes if s >= MiB):
        rules = [
            ("floor", top, "proxy_cpu_ratio", 1.0, "<=", "CPU per request <= floor's"),
            ("floor", top, "rps_ratio", 1.0, ">=", "req/s at saturation >= floor's"),
            ("floor", 16, "ttft_p50_diff_ms", 0.0, "<=", "TTFT p50 at c=16 <= floor's"),
        ]
        if size >= 4 * MiB:
            rules.append(
                ("vllm-router", 1, "ttft_p50_diff_ms", 0.0, "<=", "TTFT p50 c=1 <= router")
            )
        for other, level, key, limit, op, what in rules:
            cell = index.get(("pdproc", other, size, level))
            out.append(_verdict(cell, f"long-prompt target: {what}", size, level, key, limit, op))
    return out


# -------------------------------------------------------------------------- markdown


def fmt(stat: dict[str, Any] | None, digits: int = 1, spread: bool = True) -> str:
    if not stat or stat.get("median") is None:
        return ".."
    text = f"{stat['median']:.{digits}f}"
    if spread and stat.get("n", 0) > 1:
        text += f" [{stat['min']:.{digits}f}..{stat['max']:.{digits}f}]"
    return text


def _pct(stat: dict[str, Any] | None) -> str:
    if not stat or stat.get("median") is None:
        return ".."
    return f"{stat['median'] * 100:.0f}%"


def _intro(results: dict[str, Any]) -> list[str]:
    meta = results["meta"]
    sim = meta["sim"]
    load = f"load average {' / '.join(meta['loadavg_start'])} at the start"
    if meta.get("loadavg_end"):
        load += f", {' / '.join(meta['loadavg_end'])} at the end"
    extra = []
    if meta.get("workers", 1) > 1:
        extra.append(f"pdproc and the floor with --workers {meta['workers']}")
    if meta.get("pdproc_args"):
        extra.append(f"pdproc serve {' '.join(meta['pdproc_args'])}")
    if meta.get("envoy_options"):
        extra.append(f"pdproc's Envoy options {meta['envoy_options']}")
    if meta.get("upload_mbps"):
        extra.append(f"bodies over 64 KiB uploaded at {meta['upload_mbps']:g} MB/s")
    return [
        f"`{meta.get('command', 'python -m bench.run')}`, {meta['started'][:16]}: "
        f"simulated P/D pair on loopback, prefill {sim['prefill_delay_ms']:g} ms"
        + (f" + {sim['prefill_ms_per_kib']:g} ms/KiB" if sim["prefill_ms_per_kib"] else "")
        + f", first token {sim['first_token_delay_ms']:g} ms, {sim['itl_ms']:g} ms between "
        f"tokens, {sim['tokens']} tokens, streamed. {meta['rounds']} round(s), configurations "
        "interleaved; each number is the median over rounds, [min..max] the spread across "
        f"rounds. {meta['cpus']} CPU(s) shared by the client, Envoy, the processors, routers "
        f"and simulators ({load}).",
        *([f"Non-default: {'; '.join(extra)}."] if extra else []),
    ]


def markdown(results: dict[str, Any]) -> str:
    summary = results["summary"]
    lines = _intro(results)
    lines += ["", *_headline_lines(summary)]
    lines += [
        "",
        "CPU is each process's time on a CPU (schedstat, all its threads and workers) over "
        "the measured requests only, per completed request (ms per request = s per 1,000; "
        "utime+stime from /proc/<pid>/stat, in 10 ms ticks, is in results.json as a "
        "cross-check): *processor* is pdproc or the floor, *router* "
        "vllm-router or sglang-router, *sim* the simulated pair, *client* the load generator. "
        "*ext_proc msgs/req*: gRPC messages between Envoy and the processor, both ways "
        "(Envoy's counters). *Paired*: share of requests whose decode got its KV from a "
        "prefill (the simulated decode's count).",
        "",
        "| prompt | conc | config | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | req/s "
        "| CPU ms/req: Envoy | processor | router | sim | client | ext_proc msgs/req "
        "| paired | ok/failed |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {name: i for i, name in enumerate(CONFIGS)}
    cells = sorted(
        summary["cells"], key=lambda c: (c["size"], c["concurrency"], order.get(c["config"], 99))
    )
    for c in cells:
        cpu = " | ".join(fmt(c[f"cpu_{role}_ms"], 2, spread=False) for role in CPU_ROLES)
        lines.append(
            f"| {chart.size_label(c['size'])} | {c['concurrency']} | {c['config']} "
            f"| {fmt(c['ttft_p50_ms'])} | {fmt(c['ttft_p99_ms'])} "
            f"| {fmt(c['e2e_p50_ms'], spread=False)} | {fmt(c['rps'], 0)} | {cpu} "
            f"| {fmt(c['ext_proc_msgs_per_req'], 1, spread=False)} "
            f"| {_pct(c['paired_share'])} | {c['ok']}/{c['failed']} |"
        )
    lines += _versus_lines(summary["versus"])
    lines += _derived_lines(summary)
    if results.get("profile"):
        lines += ["", *profile_lines(results["profile"])]
    skipped = {n: i["reason"] for n, i in results["configs"].items() if i["status"] != "ok"}
    if skipped:
        lines += ["", "Skipped:", ""]
        lines += [f"- `{name}`: {reason}" for name, reason in skipped.items()]
    if results["meta"].get("truncated"):
        lines += ["", f"Run truncated by the time budget ({results['meta']['budget_s']:g} s)."]
    return "\n".join(lines) + "\n"


def _headline_lines(summary: dict[str, Any]) -> list[str]:
    head = summary.get("headline") or {}
    top, mid = head.get("saturation_concurrency"), head.get("ttft_concurrency")
    lines: list[str] = []
    for a in ("pdproc", "pdproc-1msg"):
        mine = head.get(a) or {}
        ratio = mine.get("rps_ratio_1k_saturation")
        items = []
        if ratio:
            items.append(f"throughput at 1 KiB, c={top}: {a} / floor = {fmt(ratio, 2)}")
        for cell in mine.get("by_size") or []:
            size = chart.size_label(cell["size"])
            items.append(
                f"{size}, c={mid}: TTFT p50 {a} - floor = {fmt(cell['ttft_p50_diff_ms'])} ms; "
                f"CPU per request ({a} + its Envoy) / (floor + its Envoy) = "
                f"{fmt(cell['proxy_cpu_ratio'], 2)}, processor alone "
                f"{fmt(cell['processor_cpu_ratio'], 2)}"
            )
        if items:
            lines += [f"**{a} against the floor** (same round; median [min..max]):", ""]
            lines += [f"- {item}" for item in items]
            lines.append("")
    return lines[:-1] if lines else lines


def _versus_lines(versus: list[dict[str, Any]]) -> list[str]:
    if not versus:
        return []
    lines = [
        "",
        "Same-round comparisons, median [min..max] over rounds: TTFT as *a - b* (ms), "
        "throughput and CPU as *a / b*. *Proxy CPU* is Envoy + processor (or the router).",
        "",
        "| a vs b | prompt | conc | TTFT p50 a-b | TTFT p99 a-b | req/s a/b "
        "| proxy CPU a/b | processor CPU a/b | Envoy CPU a/b |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in versus:
        lines.append(
            f"| {v['a']} vs {v['b']} | {chart.size_label(v['size'])} | {v['concurrency']} "
            f"| {fmt(v['ttft_p50_diff_ms'])} | {fmt(v['ttft_p99_diff_ms'])} "
            f"| {fmt(v['rps_ratio'], 2)} | {fmt(v['proxy_cpu_ratio'], 2)} "
            f"| {fmt(v['processor_cpu_ratio'], 2)} | {fmt(v['envoy_cpu_ratio'], 2)} |"
        )
    return lines


def _derived_lines(summary: dict[str, Any]) -> list[str]:
    derived = [d for d in summary["derived"] if d["added_ttft_p50_ms"]["median"] is not None]
    if not derived:
        return []
    lines = [
        "",
        "pdproc against Envoy alone (same round). *Raw* is pdproc's TTFT minus Envoy-alone's, "
        "so it includes the prefill itself; *net* also subtracts the P/D floor (client doing "
        "P/D directly minus client going directly to decode).",
        "",
        "| prompt | conc | added TTFT p50 raw | net | added TTFT p99 raw | net "
        "| req/s pdproc/envoy | pdproc/direct-pd | pdproc - vllm-router TTFT p50 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in derived:
        lines.append(
            f"| {chart.size_label(d['size'])} | {d['concurrency']} "
            f"| {fmt(d['added_ttft_p50_ms'])} | {fmt(d['added_ttft_p50_net_pd_floor_ms'])} "
            f"| {fmt(d['added_ttft_p99_ms'])} | {fmt(d['added_ttft_p99_net_pd_floor_ms'])} "
            f"| {fmt(d['throughput_ratio_pdproc_envoy'], 2)} "
            f"| {fmt(d['throughput_ratio_pdproc_direct_pd'], 2)} "
            f"| {fmt(d['pdproc_minus_router_ttft_p50_ms'])} |"
        )
    lines += ["", "Targets (median over rounds):", ""]
    for v in summary["targets"]:
        if v["met"] is None:
            continue
        mark = "met" if v["met"] else "NOT met"
        lines.append(
            f"- {v['target']}: {chart.size_label(v['size'])} c={v['concurrency']}, "
            f"`{v['metric']}` = {v['value']:.2f} ({v['op']} {v['limit']:g}): **{mark}**"
        )
    return lines


def profile_lines(prof: dict[str, Any]) -> list[str]:
    """Where pdproc's CPU goes beyond the floor's, from the two py-spy profiles."""
    compare = prof.get("compare")
    if not compare:
        return [f"Profile: {prof.get('skipped') or 'not taken'}."]
    lines = [
        f"**Profile** (py-spy, {chart.size_label(prof['size'])} c={prof['concurrency']}, "
        f"{prof['duration_s']} s each): CPU ms per request by thread and by component "
        "(py-spy's samples of the Python threads, scaled to those threads' measured CPU); "
        "largest excess over the floor first.",
        "",
        "| where | pdproc ms/req | floor ms/req | pdproc - floor |",
        "|---|---:|---:|---:|",
    ]
    threads = [r for r in compare if r["kind"] == "thread"]
    parts = [r for r in compare if r["kind"] != "thread"]
    # The components that differ most, either way (the full list is in profile-top.txt).
    parts = sorted(parts, key=lambda r: -abs(r["pdproc"] - r["floor"]))[:12]
    for row in threads + sorted(parts, key=lambda r: -(r["pdproc"] - r["floor"])):
        lines.append(
            f"| {row['what']} | {row['pdproc']:.3f} | {row['floor']:.3f} "
            f"| {row['pdproc'] - row['floor']:+.3f} |"
        )
    return lines
