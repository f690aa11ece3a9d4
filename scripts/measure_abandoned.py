"""Measure what clients that hang up early leave behind, per KV connector (issue 19, item 7).

    .venv/bin/python scripts/measure_abandoned.py [--clients 40] [--hang-up-s 0.3]

On loopback (simulated vLLM pair, pdproc, Envoy), `--clients` clients each send a P/D chat
request at once and hang up after `--hang-up-s`, in two cases:

- prefill_running: the prefill takes 1 s, so it is still running when the client leaves;
- decode_running: the prefill takes 20 ms and the (non-streaming) decode 2 s, so the prefill
  has finished and the decode is generating when the client leaves.

Printed per case: pdproc's request outcomes, its prefill outcomes, and the prefill pod's
side (prefills it completed, KV transfers still stored for a decode that will never pull
them), once pdproc has no stream open and no prefill in flight, and how long after the last
hang-up that took. A Markdown table, for docs/operations.md.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from pdproc_sim.devstack import Stack, running_stack
from prometheus_client.parser import text_string_to_metric_families

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}]}
CASES = {
    # name: (simulator args, max_tokens)
    "prefill_running": (["--prefill-delay-ms", "1000", "--itl-ms", "5"], 4),
    "decode_running": (["--prefill-delay-ms", "20", "--itl-ms", "50"], 40),
}


def outcomes(stack: Stack, name: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for family in text_string_to_metric_families(stack.metrics_text()):
        for sample in family.samples:
            if sample.name == name and sample.value:
                key = sample.labels["outcome"]
                found[key] = found.get(key, 0) + int(sample.value)
    return found


def hang_up(stack: Stack, max_tokens: int, after_s: float) -> float:
    headers = {"x-prefiller-host-port": str(stack.sim.prefill)}
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(
            stack.envoy.url + "/v1/chat/completions",
            json={**CHAT, "max_tokens": max_tokens},
            headers=headers,
            timeout=after_s,
        )
    return time.monotonic()


def settle(stack: Stack, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if (
            stack.metric("pdproc_streams_active") == 0
            and stack.metric("pdproc_prefills_in_flight") == 0
        ):
            return
        time.sleep(0.05)
    raise TimeoutError("pdproc still has streams or prefills in flight")


def measure(connector: str, case: str, clients: int, after_s: float) -> dict[str, Any]:
    sim_args, max_tokens = CASES[case]
    pdproc_args = ["--workers", "1", "--shutdown-delay", "0", "--engine-refresh", "0"]
    sim = [*sim_args, "--dp-ranks", "1", "--kv-timeout-s", "30"]
    with running_stack(sim, pdproc_args, kv_connector=connector) as stack:
        with ThreadPoolExecutor(clients) as pool:
            ends = list(pool.map(lambda _: hang_up(stack, max_tokens, after_s), range(clients)))
        settle(stack)
        settled_s = time.monotonic() - max(ends)
        time.sleep(1.5)  # let a prefill that was not cancelled finish on the pod
        prefill = stack.sim_get("prefill", "/sim/stats")
        return {
            "connector": connector,
            "case": case,
            "requests": outcomes(stack, "pdproc_requests_total"),
            "prefills": outcomes(stack, "pdproc_prefills_total"),
            "pod_prefills_completed": sum(prefill["served_per_rank"].values()),
            "pod_transfers": prefill["transfers"],
            "settled_after_last_hang_up_s": round(settled_s, 2),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--hang-up-s", type=float, default=0.3)
    parser.add_argument("--connectors", default="mooncake,sglang,nixlv2")
    args = parser.parse_args()
    print(
        "| connector | case | requests | prefills (pdproc) | prefills completed (pod) "
        "| transfers (pod) | settled after (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for connector in args.connectors.split(","):
        for case in CASES:
            row = measure(connector, case, args.clients, args.hang_up_s)
            print(
                f"| {row['connector']} | {row['case']} | {row['requests']} | {row['prefills']} "
                f"| {row['pod_prefills_completed']} | {row['pod_transfers']} "
                f"| {row['settled_after_last_hang_up_s']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
