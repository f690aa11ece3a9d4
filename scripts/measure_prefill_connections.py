"""How many prefill connections pdproc holds under load, against what Little's law predicts:
the figure `--max-prefill-connections` is sized by (docs/operations.md, Sizing).

    .venv/bin/python scripts/measure_prefill_connections.py [--delay-ms 20 50] [--clients 8 32 64]

A real stack on loopback (simulated vLLM pair as pdproc's static pool, `pdproc serve`,
Envoy). Per prefill delay and client count: a bounded closed loop of P/D chat requests while
a sampler reads pdproc's /metrics every 20 ms. Prints the request rate, the mean prefill
time (pdproc_prefill_duration_seconds), their product (the predicted connections in use),
and the sampled mean and peak of sum(pdproc_prefills_in_flight).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from pdproc_sim.devstack import running_stack
from prometheus_client.parser import text_string_to_metric_families

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello " * 64}], "max_tokens": 2}


def samples(page: str, name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == name
    )


def one_run(delay_ms: int, clients: int, requests: int) -> dict[str, float]:
    sim = ["--prefill-delay-ms", str(delay_ms), "--first-token-delay-ms", "5", "--itl-ms", "1"]
    with running_stack(sim_args=sim, pool=True) as stack:
        url = stack.envoy.url + "/v1/chat/completions"
        metrics_url = stack.metrics_addr.url() + "/metrics"
        in_flight: list[float] = []
        stop = threading.Event()

        def sample() -> None:
            with httpx.Client(timeout=5) as client:
                while not stop.is_set():
                    in_flight.append(
                        samples(client.get(metrics_url).text, "pdproc_prefills_in_flight")
                    )
                    time.sleep(0.02)

        def page() -> str:
            return httpx.get(metrics_url, timeout=5).text

        before = page()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        statuses: list[int] = []
        left = iter(range(requests))
        lock = threading.Lock()

        def worker() -> None:
            with httpx.Client(timeout=60) as client:
                while True:
                    with lock:
                        if next(left, None) is None:
                            return
                    statuses.append(client.post(url, json=CHAT).status_code)

        started = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            for _ in range(clients):
                pool.submit(worker)
        elapsed = time.monotonic() - started
        stop.set()
        sampler.join()
        after = page()
        count = samples(after, "pdproc_prefill_duration_seconds_count") - samples(
            before, "pdproc_prefill_duration_seconds_count"
        )
        total = samples(after, "pdproc_prefill_duration_seconds_sum") - samples(
            before, "pdproc_prefill_duration_seconds_sum"
        )
        rate = len(statuses) / elapsed
        mean_prefill = total / count if count else 0.0
        return {
            "ok": sum(1 for s in statuses if s == 200) / max(1, len(statuses)),
            "rate": rate,
            "prefill_s": mean_prefill,
            "predicted": rate * mean_prefill,
            "mean": statistics.fmean(in_flight) if in_flight else 0.0,
            "peak": max(in_flight, default=0.0),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=int, nargs="+", default=[20, 100])
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--requests", type=int, default=600, help="per run (a bounded loop)")
    args = parser.parse_args()
    print(
        "| prefill delay | clients | 200s | req/s | mean prefill | rate x prefill | "
        "in flight: mean | peak | peak / predicted |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for delay in args.delay_ms:
        for clients in args.clients:
            r = one_run(delay, clients, args.requests)
            ratio = r["peak"] / r["predicted"] if r["predicted"] else float("nan")
            print(
                f"| {delay} ms | {clients} | {r['ok']:.0%} | {r['rate']:.0f} | "
                f"{r['prefill_s'] * 1000:.1f} ms | {r['predicted']:.1f} | {r['mean']:.1f} | "
                f"{r['peak']:.0f} | {ratio:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
