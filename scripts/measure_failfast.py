"""Measure the reliability design on the simulator: how fast a failed prefill reaches the
client, and what holding the decode's response headers costs on the success path.

    .venv/bin/python scripts/measure_failfast.py [--requests 40]

Everything runs on loopback (simulated vLLM pair, pdproc, two Envoys that differ only in
response_header_mode: SEND, our design, and SKIP, no hold). Requests alternate between the
two Envoys so machine noise hits both alike; medians and p90 are printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import httpx
from pdproc_sim.devstack import Stack, free_port, running_stack, start_envoy

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}


def ttft(client: httpx.Client, url: str, target: str) -> float:
    """Seconds to the first SSE `data:` line of a streaming chat completion."""
    started = time.perf_counter()
    headers = {"x-prefiller-host-port": target}
    with client.stream(
        "POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
    ) as response:
        response.raise_for_status()
        first = None
        for line in response.iter_lines():  # read to the end: the connection is reused
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("no SSE data")
    return first


def time_to_status(client: httpx.Client, url: str, target: str) -> tuple[int, float]:
    started = time.perf_counter()
    response = client.post(
        url + "/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={"x-prefiller-host-port": target},
    )
    return response.status_code, time.perf_counter() - started


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "n": len(values),
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 2),
    }


def measure(stack: Stack, requests: int) -> dict[str, Any]:
    no_hold = start_envoy(
        stack.workdir, [stack.sim.decode], [stack.pdproc_addr],
        extra_options={"hold_response": False},
    )  # fmt: skip
    target = str(stack.sim.prefill)
    results: dict[str, Any] = {}
    try:
        with httpx.Client(timeout=60) as client:
            for _ in range(5):  # warm-up: connections, engine-id cache
                ttft(client, stack.envoy.url, target)
                ttft(client, no_hold.url, target)
            hold, skip = [], []
            for _ in range(requests):
                hold.append(ttft(client, stack.envoy.url, target))
                skip.append(ttft(client, no_hold.url, target))
            results["ttft_with_hold"] = summary(hold)
            results["ttft_without_hold"] = summary(skip)

            def failing(fault: dict[str, Any], who: str = target) -> dict[str, Any]:
                stack.sim_post("prefill", "/sim/faults", {"clear": True, **fault})
                timings, statuses = [], set()
                for _ in range(requests // 2):
                    status, seconds = time_to_status(client, stack.envoy.url, who)
                    statuses.add(status)
                    timings.append(seconds)
                stack.sim_post("prefill", "/sim/faults", {"clear": True})
                return {"status": sorted(statuses), **summary(timings)}

            results["prefill_500"] = failing({"prefill_status": 500})
            results["prefill_hang_timeout_2s"] = failing({"prefill_hang": True})
            dead = f"127.0.0.1:{free_port()}"
            status, seconds = time_to_status(client, stack.envoy.url, dead)
            results["prefill_refused_first"] = {
                "status": [status],
                "p50_ms": round(seconds * 1000, 2),
            }
            results["prefill_refused_breaker_open"] = failing({}, dead)
    finally:
        no_hold.process.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    sim = ["--prefill-delay-ms", "20", "--first-token-delay-ms", "5", "--itl-ms", "5",
           "--kv-timeout-s", "480"]  # fmt: skip
    # A breaker that never opens on 5xx/timeouts, so each failure kind is measured as such.
    pdproc = ["--prefill-timeout", "2", "--log-level", "error", "--breaker-cooldown", "60",
              "--breaker-failures", "100000"]  # fmt: skip
    with running_stack(sim, pdproc) as stack:
        results = measure(stack, args.requests)
    print("| measurement | status | n | p50 ms | p90 ms |")
    print("|---|---|---|---|---|")
    for name, row in results.items():
        status = ",".join(map(str, row.get("status", [200])))
        print(
            f"| {name} | {status} | {row.get('n', 1)} | {row['p50_ms']} | {row.get('p90_ms', '')} |"
        )


if __name__ == "__main__":
    main()
