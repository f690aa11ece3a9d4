"""Peak resident memory of one pdproc worker against the request-body bytes it holds.

Runs the simulated stack on loopback (Envoy + pdproc + the simulated pair), holds `--conc`
requests of each size in flight behind a slow prefill (4 s), samples pdproc's VmRSS every
20 ms, and prints the growth over idle against the body bytes held. The numbers in
docs/operations.md ("Sizing") come from it:

    .venv/bin/python scripts/measure_memory.py
"""

from __future__ import annotations

import argparse
import concurrent.futures
import threading
import time

import httpx
from pdproc_sim.devstack import running_stack


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(connector: str, mib: int, conc: int) -> None:
    sim = ["--prefill-delay-ms", "4000", "--itl-ms", "1"]
    limits = ["--max-inflight-bytes", str(4 << 30), "--max-body-bytes", str(64 << 20)]
    with running_stack(sim, limits, pool=True, kv_connector=connector) as stack:
        pid = stack.pdproc.popen.pid
        url = stack.envoy.url + "/v1/completions"
        body = {"model": "sim-model", "max_tokens": 2, "prompt": "tok " * (mib * 1024 * 256)}
        with httpx.Client(timeout=60) as client:  # warm up: connections, caches, imports
            client.post(url, json={"model": "sim-model", "max_tokens": 2, "prompt": "x"})
        time.sleep(0.5)
        idle = peak = resident_bytes(pid)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, resident_bytes(pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()

        def one(_: int) -> int:
            with httpx.Client(timeout=120) as client:
                return client.post(url, json=body).status_code

        with concurrent.futures.ThreadPoolExecutor(conc) as pool:
            codes = sorted(set(pool.map(one, range(conc))))
        done.set()
        sampler.join()
        held = mib * conc
        grown = (peak - idle) / 2**20
        print(
            f"{connector:9} {mib:2} MiB x c={conc:2}: status {codes}, idle {idle / 2**20:.0f} MiB,"
            f" peak {peak / 2**20:.0f} MiB, +{grown:.0f} MiB for {held} MiB held"
            f" = {grown / held:.2f}x",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4", help="body sizes in MiB, comma-separated")
    parser.add_argument("--conc", type=int, default=16, help="requests held at once")
    args = parser.parse_args()
    for mib in (int(size) for size in args.sizes.split(",")):
        for connector in ("nixlv2", "mooncake"):
            measure(connector, mib, args.conc)


if __name__ == "__main__":
    main()
