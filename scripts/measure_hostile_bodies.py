"""Hostile bodies through a real stack (simulated vLLM pair, `pdproc serve`, Envoy): what
they cost and what other users see meanwhile.

    .venv/bin/python scripts/measure_hostile_bodies.py --pdproc up     # pdproc's body check
    .venv/bin/python scripts/measure_hostile_bodies.py --pdproc up --body distinct-keys --count 1
    .venv/bin/python scripts/measure_hostile_bodies.py --pdproc down   # the kv guard alone

`up`: six (`--count`) bodies sent at once while one other user sends small P/D chat
requests one after another; the bodies (`--body`) are 16 MiB wide arrays
(`{"model":"m","x":[0,0,...],"y":2**64}`), 8 MiB of distinct top-level keys
(`{"model":"m","k0":0,"k1":0,...}`) or 16 MiB string prompts refused for a 2**64 integer.
`--count 1` gives one body's cost. `down` (pdproc stopped, Envoy fails open): six 16 MiB
bodies of `[],[],...` ending in a client kv_transfer_params, then one 8 MiB deep body,
while another user sends GET /v1/models. Prints the attack bodies' answers, how many
reached the decode, Envoy's ext_proc message timeouts, the CPU and peak resident memory
of pdproc (up) or Envoy (down), and the other user's latency.

To measure another version, put its checkout first on PYTHONPATH and run from outside this
checkout (`git archive <commit> pdproc | tar -x -C /tmp/before; cd /; PYTHONPATH=/tmp/before
/path/.venv/bin/python /path/scripts/measure_hostile_bodies.py`): pdproc serve and the
Envoy config (its kv guard) then both come from it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from pdproc_sim.devstack import PeakMemory, Stack, resident_bytes, running_stack

MiB = 1024 * 1024
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'


def reset_peak(pid: int) -> None:
    """Reset the kernel's peak resident memory of a process (VmHWM) to its current RSS."""
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")


def kernel_peak(pid: int) -> int:
    """The process's peak resident memory since `reset_peak` (VmHWM), bytes."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, clock ticks


_VICTIM = r"""
import sys, time, httpx
url, header = sys.argv[1], sys.argv[2]
body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
with httpx.Client(timeout=60) as client:
    for _ in range(2000):
        start = time.perf_counter()
        if header:
            client.post(url + "/v1/chat/completions", content=body,
                        headers={"x-prefiller-host-port": header})
        else:
            client.get(url + "/v1/models")
        print(time.perf_counter() - start, flush=True)
"""


class Victim:
    """Another user, in a process of its own (not slowed by this one's threads): requests
    one after another until stopped."""

    def __init__(self, stack: Stack, up: bool) -> None:
        header = str(stack.sim.prefill) if up else ""
        self.popen = subprocess.Popen(
            [sys.executable, "-c", _VICTIM, stack.envoy.url, header],
            stdout=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> list[float]:
        self.popen.terminate()
        out, _ = self.popen.communicate(timeout=60)
        return [float(line) for line in out.split()]


def attack(stack: Stack, body: bytes) -> int:
    reply = httpx.post(
        stack.envoy.url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=120,
    )
    return reply.status_code


def up_body(shape: str) -> bytes:
    if shape == "distinct-keys":
        keys = b",".join(b'"k%d":0' % i for i in range(8 * MiB // 10))
        return (b'{"model":"m",' + keys)[: 8 * MiB].rsplit(b",", 1)[0] + b"}"
    if shape == "string-prompt":
        prompt = b"x" * (16 * MiB - 60)
        return b'{"model":"m","prompt":"' + prompt + b'","y":18446744073709551616}'
    return b'{"model":"m","x":[' + b"0," * (8 * MiB - 40) + b'0],"y":18446744073709551616}'


def bodies(up: bool, shape: str, count: int) -> list[bytes]:
    if up:
        return [up_body(shape)] * count
    empties = b'{"model":"m","x":[' + b"[]," * (16 * MiB // 3 - 40) + b'[]],"kv_transfer_params":1}'
    deep = b'{"model":"m","x":' + b"[" * (8 * MiB - 64) + b"]" * (8 * MiB - 64) + b"}"
    return [empties] * 6 + [deep]


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"n={len(values)} p50 {statistics.median(values) * 1000:.0f} ms, "
        f"p99 {p99 * 1000:.0f} ms, max {max(values) * 1000:.0f} ms"
    )


def run(up: bool, shape: str = "wide-array", count: int = 6) -> None:
    with running_stack(["--dp-ranks", "2"], ["--shutdown-delay", "0"]) as stack:
        if not up:
            stack.pdproc.stop()
        watched = (stack.pdproc if up else stack.envoy.process).popen.pid
        other = Victim(stack, up)
        time.sleep(3)
        baseline = other.stop()
        decode_before = stack.envoy.stats("cluster.decode.").get(
            "cluster.decode.upstream_rq_total", 0
        )
        stats_before = stack.envoy.stats("http.ingress.ext_proc.")
        rss_before = resident_bytes(watched)
        cpu_before = cpu_s(watched)
        reset_peak(watched)
        sent = bodies(up, shape, count)
        with PeakMemory(watched) as peak:
            other = Victim(stack, up)
            time.sleep(1.5)  # it is sending before the attack starts
            with ThreadPoolExecutor(len(sent)) as pool:
                statuses = list(pool.map(lambda b: attack(stack, b), sent))
            during = other.stop()
        cpu = cpu_s(watched) - cpu_before
        hwm = kernel_peak(watched)
        stats = stack.envoy.stats("http.ingress.ext_proc.")
        # Every request the other user sent reached the decode once; the rest are attack bodies.
        decode_rq = stack.envoy.stats("cluster.decode.").get("cluster.decode.upstream_rq_total", 0)
        reached = decode_rq - decode_before - len(during)
        timeouts = {
            k: stats.get(k, 0) - stats_before.get(k, 0)
            for k in stats
            if "timeout" in k or "failure_mode_allowed" in k
        }
        who = "pdproc" if up else "envoy"
        print(
            f"attack answers: {statuses}; decode requests beyond the other user's: {reached} "
            "(one may be the other user's request cut off when it was stopped)"
        )
        print(f"ext_proc counters moved: {timeouts}")
        print(
            f"{who}: CPU {cpu:.2f} s for {len(sent)} bodies "
            f"({cpu / len(sent) * 1000:.0f} ms each); "
            f"RSS {rss_before / MiB:.0f} -> peak {peak.peak / MiB:.0f} MiB sampled, "
            f"{hwm / MiB:.0f} MiB VmHWM "
            f"({len(sent[0]) / MiB:.1f} MiB bodies)"
        )
        print(f"other user, before: {summary(baseline)}")
        print(f"other user, during: {summary(during)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pdproc", choices=["up", "down"], default="up")
    parser.add_argument(
        "--body", choices=["wide-array", "distinct-keys", "string-prompt"], default="wide-array"
    )
    parser.add_argument("--count", type=int, default=6, help="bodies sent at once (up)")
    args = parser.parse_args()
    run(args.pdproc == "up", args.body, args.count)


if __name__ == "__main__":
    main()
