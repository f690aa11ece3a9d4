"""What pdproc's body check costs for wide bodies: CPU per body and resident memory.

Each body shape is checked by `pdproc.request_body.parse_body` in a fresh Python process (so
one shape's memory does not hide another's), which reports the CPU time of the check and the
peak of what it allocated (tracemalloc: msgspec's and orjson's allocations included):

    .venv/bin/python scripts/measure_wide_body.py [--size-mib 16]

To measure another version of the module, put its checkout first on PYTHONPATH, e.g.
`git archive <commit> pdproc | tar -x -C /tmp/before && PYTHONPATH=/tmp/before .venv/bin/python
scripts/measure_wide_body.py`. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MiB = 1024 * 1024

_CHILD = r"""
import json, sys, time, tracemalloc
from pdproc.request_body import BodyError, parse_body
size, shape = int(sys.argv[1]), sys.argv[2]
tail = b'],"y":18446744073709551616}'
if shape == "string prompt":
    raw = b'{"model":"m","prompt":"' + b"x" * (size - 60) + b'","y":18446744073709551616}'
elif shape == "array of 0":
    raw = b'{"model":"m","x":[' + b"0," * (size // 2 - 30) + b"0" + tail
elif shape == "array of {}":
    raw = b'{"model":"m","x":[' + b"{}," * (size // 3 - 30) + b"{}" + tail
elif shape == "array of []":
    raw = b'{"model":"m","x":[' + b"[]," * (size // 3 - 30) + b"[]" + tail
elif shape == "distinct top-level keys":
    count = size // 2 // 12
    raw = b"{" + b",".join(b'"k%09d":0' % i for i in range(count)) + b',"y":18446744073709551616}'
elif shape == "chat messages":
    message = b'{"role":"user","content":"' + b"x" * 100 + b'"}'
    count = size // (len(message) + 1)
    raw = b'{"model":"m","messages":[' + b",".join([message] * count) + b'],"y":1}'
tracemalloc.start()
start = time.process_time()
try:
    parse_body(raw)
    verdict = "accepted"
except BodyError as exc:
    verdict = "400: " + str(exc)[:60]
cpu = time.process_time() - start
grown = tracemalloc.get_traced_memory()[1] // 1024
print(json.dumps({"cpu_s": cpu, "grown_kib": grown, "verdict": verdict, "bytes": len(raw)}))
"""

SHAPES = (
    "string prompt",
    "array of 0",
    "array of {}",
    "array of []",
    "distinct top-level keys",
    "chat messages",
)


def measure(size: int, shape: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(size), shape],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",  # not this checkout's pdproc first on the path: PYTHONPATH decides
    ).stdout
    result: dict[str, object] = json.loads(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=16)
    args = parser.parse_args()
    size = int(args.size_mib * MiB)
    print("| body | bytes | CPU of the check | peak memory allocated (tracemalloc) | answer |")
    print("|---|---|---|---|---|")
    for shape in SHAPES:
        r = measure(size, shape)
        print(
            f"| {shape} | {r['bytes']:,} | {float(str(r['cpu_s'])) * 1000:.0f} ms | "
            f"{int(str(r['grown_kib'])) / 1024:.0f} MiB | {r['verdict']} |"
        )


if __name__ == "__main__":
    main()
