"""The cost of one prefix-aware pick (pdproc.prefix_affinity), keys included (from a body
parsed as pdproc parses it), at a given prompt size, with warm per-pod sets:
`python scripts/measure_prefix_pick.py --bytes 1024`.

Prints the median and p90 over repeated timed batches (a noisy shared machine: read the
median). Not a test: speed is measured, never asserted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import tracemalloc

import msgspec

from pdproc.prefix_affinity import PrefixAffinity, Prompt
from pdproc.request_body import parse_body
from pdproc.targets import HostPort


def _bodies(count: int, size: int, systems: int) -> list[dict[str, object]]:
    rng = random.Random(1)
    prompts = ["".join(rng.choice("abcdefgh ") for _ in range(size // 2)) for _ in range(systems)]
    return [
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": prompts[i % systems]},
                {"role": "user", "content": f"{i} " + "q" * (size // 2 - 8)},
            ],
        }
        for i in range(count)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bytes", type=int, default=1024, help="prompt size")
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--per-batch", type=int, default=500)
    parser.add_argument("--blocks-per-pod", type=int, default=16384)
    args = parser.parse_args()
    pods = [HostPort(f"10.0.0.{i + 1}", 8000) for i in range(args.pods)]
    loads = dict.fromkeys(pods, 0)
    # As pdproc has them: members of the client's JSON, parsed lazily.
    bodies = [parse_body(msgspec.json.encode(b)) for b in _bodies(args.per_batch, args.bytes, 6)]
    tracemalloc.start()
    affinity: PrefixAffinity[HostPort] = PrefixAffinity(args.blocks_per_pod)
    # Fill every pod's set to its bound, as after a long run.
    filler = 0
    while min((affinity.known().get(p, 0) for p in pods), default=0) < args.blocks_per_pod:
        filler += 1
        prompt = Prompt.of({"model": "m", "prompt": f"{filler} " + "z" * 4000})
        affinity.record(pods[filler % len(pods)], prompt)
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    times = []
    for _ in range(args.batches):
        started = time.perf_counter()
        for body in bodies:
            prompt = Prompt.of(body)
            affinity.choose(prompt, pods, loads.__getitem__)
        times.append((time.perf_counter() - started) / len(bodies) * 1e6)
    times.sort()
    p90 = times[int(len(times) * 0.9) - 1]
    sys.stdout.write(
        f"prompt {args.bytes} B, {args.pods} pods, {args.blocks_per_pod} blocks/pod: "
        f"pick best batch {times[0]:.1f} us, median {statistics.median(times):.1f} us, "
        f"p90 {p90:.1f} us; "
        f"index {index_bytes / 2**20:.1f} MiB for {affinity.blocks} blocks "
        f"({index_bytes / max(1, affinity.blocks):.0f} B/block)\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
