"""Multi-turn chat against a prefill pool: what each pool policy costs in prefill work.

    python -m bench.multiturn                  # both workloads, every configuration, 2 rounds
    python -m bench.multiturn --rounds 3 --configs least-loaded,prefix

Simulated pods (pdproc_sim.poolstack): P prefill pods on their own loopback addresses,
each with a vLLM-like prefix cache (16-token blocks, LRU), one prefill at a time per DP rank
(FIFO) and compute time per *uncached* token, and D decodes that cache what they received
and generated. Clients run a closed loop of conversations: a shared system prompt picked by
Zipf popularity, then turns whose history grows by the question and the streamed answer.
The no-reuse workload (one turn, a system prompt of its own per conversation) is the
regression guard: there, no policy can find anything cached.

Configurations, each started fresh (empty caches) for every run, runs interleaved by round:

- `random`         vllm-router, --prefill-policy random (decode round robin)
- `least-loaded`   Envoy + pdproc --pool-policy least-loaded (the old pool choice)
- `prefix`         Envoy + pdproc (the default: prefix policy), 1 worker
- `prefix-decode`  prefix, and pdproc names the decode too (--decode-choice prefix; Envoy's
                   decode cluster routes on it): a turn goes to the decode holding its
                   history, and skips P/D when that decode holds 80 % of the prompt
- `prefix-2w`      the same as prefix with --workers 2 (each process its own index)
- `cache-aware`    vllm-router --prefill-policy cache_aware (decode round robin)

Per run, from the pods' own vLLM-named metrics (`vllm:prompt_tokens_by_source_total`):
prompt tokens computed (by the prefill pods, plus by decodes serving a request alone:
their local_compute, which is 0 while every request is disaggregated), of them by decodes,
the prefill pods' hit rate, KV tokens transferred (the decodes' external_kv_transfer: what
they pulled from a prefill, the blocks they held already not counted), prefills per pod
(max / mean), requests a decode served alone holding the prompt (P/D skipped); from the
client: TTFT p50 / p99 over streamed answers past the first one per client (and the p99
of all); from /proc: the processor's CPU seconds
(pdproc, or vllm-router) and resident memory at the end. The table gives each
configuration's median over the rounds and, for the ratios against least-loaded (measured
in the same rounds), the min-max spread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pdproc_sim import devstack
from pdproc_sim.poolstack import SimPool, running_pool
from prometheus_client.parser import text_string_to_metric_families

from bench.stack import cpu_delta, router_binary, tree_cpu
from pdproc.targets import HostPort

CONFIGS = ("random", "least-loaded", "prefix", "prefix-decode", "prefix-2w", "cache-aware")
PDPROC_ARGS = {
    "least-loaded": ["--pool-policy", "least-loaded"],
    "prefix": [],
    "prefix-decode": ["--decode-choice", "prefix"],
    "prefix-2w": ["--workers", "2"],
}
# Configurations whose Envoy routes on pdproc's decode choice (pdproc is told the decodes).
DECODE_CHOICE = frozenset({"prefix-decode"})
ROUTER_POLICY = {"random": "random", "cache-aware": "cache_aware"}


@dataclass(frozen=True)
class Workload:
    name: str
    conversations: int
    turns: int
    systems: int  # distinct shared system prompts (0: one of its own per conversation)
    system_chars: int
    user_chars: int
    zipf: float
    max_tokens: int
    clients: int


# 16 clients on 4 prefill pods of one prefill at a time: prefills queue, so the tokens a
# policy makes the pods recompute show in every request's TTFT, as on a busy pool.
WORKLOADS = {
    "shared": Workload("shared", 40, 4, 6, 8000, 400, 1.1, 16, 16),
    "no-reuse": Workload("no-reuse", 80, 1, 0, 8000, 400, 1.1, 16, 16),
}


@dataclass(frozen=True)
class SimTiming:
    prefill_pods: int = 4
    decodes: int = 2
    ms_per_token: float = 0.05  # 2,000 uncached tokens: 100 ms
    prefill_delay_ms: float = 2.0
    # Per engine: 8k tokens, four of the six shared system prompts. A pod that could hold
    # every system prompt and every history gives every policy the same hits; a real pod's
    # KV cache holds a fraction of what its pool serves.
    cache_blocks: int = 512
    decode_cache_blocks: int = 4096
    itl_ms: float = 5.0


def conversations(work: Workload, seed: int) -> list[tuple[str, list[str]]]:
    """(system prompt, questions) per conversation; the same for every configuration."""
    rng = random.Random(seed)
    words = ["the", "of", "a", "prefill", "decode", "cache", "block", "token", "route"]

    def text(chars: int, tag: str) -> str:
        out = [tag]
        while sum(len(w) + 1 for w in out) < chars:
            out.append(rng.choice(words))
        return " ".join(out)[:chars]

    systems = [text(work.system_chars, f"system {i}:") for i in range(work.systems)]
    weights = [1 / (rank + 1) ** work.zipf for rank in range(work.systems)]
    out = []
    for index in range(work.conversations):
        if systems:
            system = rng.choices(systems, weights)[0]
        else:
            system = text(work.system_chars, f"own system {index}:")
        questions = [text(work.user_chars, f"c{index} q{t}:") for t in range(work.turns)]
        out.append((system, questions))
    return out


@dataclass
class Run:
    config: str
    workload: str
    round: int
    requests: int = 0
    errors: int = 0
    ttft_s: list[float] = field(default_factory=list)  # in the order the answers came
    # The first answers, one per client, are left out of the TTFT percentiles (not of the
    # tokens): every client starts at once against cold pods, a burst of misses that every
    # policy queues alike. It is the p99 of a run this short (the 2nd-worst of 160), so
    # the p99 of all answers is given beside it.
    warmup: int = 0
    computed: float = 0.0
    cached: float = 0.0
    kv_transferred: float = 0.0
    decode_computed: float = 0.0  # prompt tokens decodes computed serving requests alone
    prefills_per_pod: list[float] = field(default_factory=list)
    computed_per_pod: list[float] = field(default_factory=list)
    cpu_s: float | None = None
    rss_mib: float | None = None
    index_blocks: float | None = None  # pdproc_prefix_index_blocks at the end
    decode_cached: float | None = None  # requests a decode served alone, holding the prompt
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        ttft = sorted(self.ttft_s[self.warmup :])
        pods = self.prefills_per_pod
        mean = statistics.mean(pods) if pods else 0.0
        return {
            "config": self.config,
            "workload": self.workload,
            "round": self.round,
            "requests": self.requests,
            "errors": self.errors,
            "prefill_computed": self.computed,
            "decode_computed": self.decode_computed,
            "prompt_computed": self.computed + self.decode_computed,
            "hit_rate": self.cached / max(1.0, self.cached + self.computed),
            "kv_transferred": self.kv_transferred,
            "ttft_p50": _quantile(ttft, 0.5),
            "ttft_p99": _quantile(ttft, 0.99),
            "ttft_p99_all": _quantile(sorted(self.ttft_s), 0.99),
            "load_max_mean": max(pods) / mean if mean else None,
            "work_max_mean": _max_mean(self.computed_per_pod),
            "cpu_s": self.cpu_s,
            "rss_mib": self.rss_mib,
            "index_blocks": self.index_blocks,
            "decode_cached": self.decode_cached,
            "wall_s": self.wall_s,
        }


def _max_mean(values: Sequence[float]) -> float | None:
    mean = statistics.mean(values) if values else 0.0
    return max(values) / mean if mean else None


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


async def _turn(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], work: Workload, run: Run
) -> str | None:
    body = {"model": "m", "messages": messages, "max_tokens": work.max_tokens, "stream": True}
    started = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                run.errors += 1
                return None
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: ") :])
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text.append(piece)
    except httpx.HTTPError:
        run.errors += 1
        return None
    run.requests += 1
    if first is not None:
        run.ttft_s.append(first - started)
    return "".join(text)


async def _client(
    queue: asyncio.Queue[tuple[str, list[str]]], url: str, work: Workload, run: Run
) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        while True:
            try:
                system, questions = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            messages = [{"role": "system", "content": system}]
            for question in questions:
                messages.append({"role": "user", "content": question})
                answer = await _turn(client, url, messages, work, run)
                if answer is None:
                    break
                messages.append({"role": "assistant", "content": answer})


async def _load(url: str, work: Workload, run: Run, seed: int) -> None:
    queue: asyncio.Queue[tuple[str, list[str]]] = asyncio.Queue()
    for item in conversations(work, seed):
        queue.put_nowait(item)
    await asyncio.gather(*(_client(queue, url, work, run) for _ in range(work.clients)))


def _samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    page = httpx.get(url + "/metrics", timeout=10).text
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(page)
        for s in family.samples
    ]


def _read_pods(pool: SimPool, run: Run) -> None:
    for member in pool.prefills:
        computed = 0.0
        for name, labels, value in _samples(member.url()):
            if name == "vllm:prompt_tokens_by_source_total":
                if labels["source"] == "local_compute":
                    computed += value
                elif labels["source"] == "local_cache_hit":
                    run.cached += value
        run.computed += computed
        run.computed_per_pod.append(computed)
        stats = httpx.get(member.url() + "/sim/stats", timeout=10).json()
        run.prefills_per_pod.append(sum(stats["served_per_rank"].values()))
    for decode in pool.decodes:
        for name, labels, value in _samples(decode.url()):
            if name != "vllm:prompt_tokens_by_source_total":
                continue
            if labels["source"] == "external_kv_transfer":
                run.kv_transferred += value
            elif labels["source"] == "local_compute":
                # A decode serving a request alone computes what it lacks: prompt work too.
                run.decode_computed += value


@contextlib.contextmanager
def _front(config: str, pool: SimPool, workdir: Path) -> Iterator[tuple[str, int, HostPort | None]]:
    """The configuration's front door (URL), its processor's pid and (pdproc) metrics."""
    procs: list[devstack.Process] = []
    try:
        if config in PDPROC_ARGS:
            args = ["--prefill-allow", "127.0.0.0/8", "--log-level", "warning"]
            args += ["--mooncake-bootstrap-port", str(pool.bootstrap_port)]
            for member in pool.prefills:
                args += ["--prefill", str(member)]
            choice = config in DECODE_CHOICE
            for decode in pool.decodes if choice else ():
                args += ["--decode", str(decode)]
            proc, addr, metrics = devstack.start_pdproc(
                workdir, [*args, *PDPROC_ARGS[config]], name=f"pdproc-{config}"
            )
            procs.append(proc)
            envoy = devstack.start_envoy(
                workdir, pool.decodes, [addr], extra_options={"decode_choice": choice}
            )
            procs.append(envoy.process)
            yield envoy.url, proc.popen.pid, metrics
        else:
            yield (*_start_router(config, pool, workdir, procs), None)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _start_router(
    config: str, pool: SimPool, workdir: Path, procs: list[devstack.Process]
) -> tuple[str, int]:
    binary = router_binary()
    if binary is None:
        raise RuntimeError("vllm-router not installed (pip install -r bench/requirements.txt)")
    port, prometheus = devstack.free_port(), devstack.free_port()
    argv = [binary, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--vllm-pd-disaggregation", "--kv-connector", "mooncake"]
    for member in pool.prefills:
        argv += ["--prefill", member.url(), str(pool.bootstrap_port)]
    for decode in pool.decodes:
        argv += ["--decode", decode.url()]
    argv += ["--prefill-policy", ROUTER_POLICY[config], "--decode-policy", "round_robin"]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus)]
    argv += ["--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "30"]
    proc = devstack.spawn(f"router-{config}", argv, workdir)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    devstack.wait_for(
        lambda: devstack.http_get(url + "/health")[0] == 200, "vllm-router", 45.0, proc=proc
    )
    return url, proc.popen.pid


def sim_args(timing: SimTiming) -> tuple[list[str], list[str]]:
    prefill = ["--prefix-cache-blocks", str(timing.cache_blocks), "--rank-concurrency", "1"]
    prefill += ["--prefill-ms-per-token", str(timing.ms_per_token)]
    prefill += ["--prefill-delay-ms", str(timing.prefill_delay_ms)]
    decode = ["--prefix-cache-blocks", str(timing.decode_cache_blocks)]
    decode += ["--itl-ms", str(timing.itl_ms), "--prefill-ms-per-token", str(timing.ms_per_token)]
    return prefill, decode


def one_run(
    config: str, work: Workload, round_: int, timing: SimTiming, workdir: Path, seed: int
) -> Run:
    run = Run(config, work.name, round_, warmup=work.clients)
    prefill_args, decode_args = sim_args(timing)
    with (
        running_pool(
            workdir, timing.prefill_pods, timing.decodes, prefill_args, decode_args
        ) as pool,
        _front(config, pool, workdir) as (url, pid, metrics),
    ):
        before = tree_cpu(pid)
        started = time.perf_counter()
        asyncio.run(_load(url, work, run, seed))
        run.wall_s = time.perf_counter() - started
        on_cpu, _ = cpu_delta(before, tree_cpu(pid))
        run.cpu_s = on_cpu
        with contextlib.suppress(OSError, ValueError):
            pids = [pid, *tree_cpu(pid).stat.keys()]
            run.rss_mib = sum(devstack.resident_bytes(p) for p in set(pids)) / 2**20
        _read_pods(pool, run)
        if metrics is not None:
            run.index_blocks = devstack.scrape_metric(metrics, "pdproc_prefix_index_blocks")
            run.decode_cached = devstack.scrape_metric(
                metrics, "pdproc_requests_total", outcome="decode_cached"
            )
    return run


def table(summaries: list[dict[str, Any]], configs: Sequence[str]) -> str:
    """Medians per configuration and workload; ratios against least-loaded of the same
    round, median with the min-max spread."""
    lines = [
        "| workload | config | prompt tokens computed | vs least-loaded | of them by decodes | "
        "prefill hit rate | KV "
        "tokens transferred | TTFT p50 s | p50 vs LL | TTFT p99 s | p99 vs LL | "
        "p99 of all answers vs LL | prefills/pod "
        "max/mean | computed/pod max/mean | CPU s | RSS MiB | index blocks | P/D skipped | "
        "errors |",
        "|" + "---|" * 19,
    ]
    workloads = sorted({s["workload"] for s in summaries}, key=list(WORKLOADS).index)
    for workload in workloads:
        rows = [s for s in summaries if s["workload"] == workload]
        base = {s["round"]: s for s in rows if s["config"] == "least-loaded"}
        for config in configs:
            mine = [s for s in rows if s["config"] == config]
            if not mine:
                continue
            lines.append(_row(workload, config, mine, base))
    return "\n".join(lines)


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def _ratio(rows: list[dict[str, Any]], base: dict[int, dict[str, Any]], key: str) -> str:
    ratios = [
        r[key] / base[r["round"]][key]
        for r in rows
        if r["round"] in base and r[key] is not None and base[r["round"]][key]
    ]
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(
    workload: str, config: str, rows: list[dict[str, Any]], base: dict[int, dict[str, Any]]
) -> str:
    cells = [
        workload,
        config,
        _fmt(_median(rows, "prompt_computed"), 0),
        _ratio(rows, base, "prompt_computed"),
        _fmt(_median(rows, "decode_computed"), 0),
        _fmt(_median(rows, "hit_rate")),
        _fmt(_median(rows, "kv_transferred"), 0),
        _fmt(_median(rows, "ttft_p50"), 3),
        _ratio(rows, base, "ttft_p50"),
        _fmt(_median(rows, "ttft_p99"), 3),
        _ratio(rows, base, "ttft_p99"),
        _ratio(rows, base, "ttft_p99_all"),
        _fmt(_median(rows, "load_max_mean")),
        _fmt(_median(rows, "work_max_mean")),
        _fmt(_median(rows, "cpu_s")),
        _fmt(_median(rows, "rss_mib"), 0),
        _fmt(_median(rows, "index_blocks"), 0),
        _fmt(_median(rows, "decode_cached"), 0),
        str(sum(r["errors"] for r in rows)),
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("build/multiturn"))
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    workloads = [WORKLOADS[w] for w in args.workloads.split(",") if w]
    timing = SimTiming()
    args.out.mkdir(parents=True, exist_ok=True)
    summaries: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for work in workloads:
            # Each round in another order: drift on a shared machine spreads over all.
            order = configs[round_ % len(configs) :] + configs[: round_ % len(configs)]
            for config in order:
                with tempfile.TemporaryDirectory(prefix="pdproc-multiturn-") as tmp:
                    try:
                        run = one_run(config, work, round_, timing, Path(tmp), args.seed)
                    except RuntimeError as exc:
                        sys.stderr.write(f"{config}: skipped: {exc}\n")
                        continue
                summary = run.summary()
                summaries.append(summary)
                sys.stderr.write(json.dumps(summary) + "\n")
    (args.out / "results.json").write_text(
        json.dumps({"timing": asdict(timing), "runs": summaries}, indent=1)
    )
    text = table(summaries, configs)
    (args.out / "table.md").write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
