"""What the kv guard (pdproc/envoy_config/kv_guard.lua) costs, measured through real Envoys.

Two Envoys that differ only in the guard sit in front of the same simulated decode pod, and
requests alternate between them (one at a time, so the two see the same machine):

- fail-open: pdproc is down, ext_proc fails open and the guard scans every body. This is the
  guard's whole cost: buffering the body, copying it into Lua and walking its top level.
- pdproc up: pdproc has checked the body (pdproc.body_checked), so the guard only looks at
  that mark (two-message mode: before the body arrives, so nothing is buffered).

    .venv/bin/python scripts/measure_kv_guard.py [--requests 200] [--size-mib 1] [--single-message]

(--single-message: both Envoys in single-message mode, where the guard waits for the body
before it looks at pdproc's mark, also when pdproc is up.)

Prints one Markdown table: client latency p50 / p90 with and without the guard, per body
shape (one long prompt string; a prompt with a JSON escape every 16 bytes; thousands of
small chat messages, i.e. many JSON tokens inside one top-level value).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
from pdproc_sim.devstack import Envoy, start_envoy, start_pdproc, start_sim

MiB = 1024 * 1024


def bodies(size: int) -> dict[str, bytes]:
    line = "token " * 2 + "x\n"  # 16 characters, one escape ("\n") each
    messages = [{"role": "user", "content": "m" * 100}] * (size // 128)
    return {
        "one long string": orjson.dumps({"model": "m", "prompt": "x" * size, "max_tokens": 1}),
        "escape every 16 B": orjson.dumps(
            {"model": "m", "prompt": line * (size // 16), "max_tokens": 1}
        ),
        f"{len(messages)} chat messages": orjson.dumps(
            {"model": "m", "messages": messages, "max_tokens": 1}
        ),
    }


def path_for(name: str) -> str:
    return "/v1/chat/completions" if "messages" in name else "/v1/completions"


@contextlib.contextmanager
def envoys(
    workdir: Path, pdproc_up: bool, single_message: bool
) -> Iterator[tuple[Envoy, Envoy, str]]:
    sim = start_sim(workdir, ["--dp-ranks", "1"])
    started = [sim.process]
    try:
        processors = []
        header = ""
        if pdproc_up:
            args = ["--prefill-allow", "127.0.0.1/32", "--prefill", str(sim.prefill)]
            args += ["--mooncake-bootstrap-port", str(sim.bootstrap.port)]
            proc, addr, _ = start_pdproc(workdir, args)
            started.append(proc)
            processors = [addr]
            header = str(sim.prefill)
        mode = {"single_message": single_message}
        with_guard = start_envoy(workdir, [sim.decode], processors, extra_options=mode)
        started.append(with_guard.process)
        without = start_envoy(
            workdir, [sim.decode], processors, extra_options={**mode, "kv_guard": False}
        )
        started.append(without.process)
        yield with_guard, without, header
    finally:
        for proc in reversed(started):
            proc.stop()


def timed(client: httpx.Client, url: str, body: bytes) -> float:
    started = time.perf_counter()
    response = client.post(url, content=body, headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{url}: {response.status_code} {response.text[:200]}")
    return elapsed * 1000


def percentiles(samples: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(samples, n=10)
    return statistics.median(samples), cuts[8]


def measure(
    requests: int, size: int, pdproc_up: bool, single_message: bool
) -> list[dict[str, Any]]:
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="pdproc-guard-") as tmp,
        envoys(Path(tmp), pdproc_up, single_message) as (with_guard, without, _),
        httpx.Client(timeout=60) as client,
    ):
        for name, body in bodies(size).items():
            path = path_for(name)
            for envoy in (with_guard, without):  # warm up
                timed(client, envoy.url + path, body)
            on: list[float] = []
            off: list[float] = []
            for _ in range(requests):
                on.append(timed(client, with_guard.url + path, body))
                off.append(timed(client, without.url + path, body))
            p50_on, p90_on = percentiles(on)
            p50_off, p90_off = percentiles(off)
            rows.append(
                {
                    "mode": ("pdproc up" if pdproc_up else "fail-open (pdproc down)")
                    + (", single-message" if single_message else ""),
                    "body": f"{name} ({len(body) / MiB:.2f} MiB)",
                    "with": (p50_on, p90_on),
                    "without": (p50_off, p90_off),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="per body shape and Envoy")
    parser.add_argument("--size-mib", type=float, default=1.0)
    parser.add_argument("--single-message", action="store_true")
    args = parser.parse_args()
    size = int(args.size_mib * MiB)
    rows = measure(args.requests, size, False, args.single_message)
    rows += measure(args.requests, size, True, args.single_message)
    print("| mode | body | p50 / p90 ms with the guard | without | p50 difference |")
    print("|---|---|---|---|---|")
    for row in rows:
        on, off = row["with"], row["without"]
        print(
            f"| {row['mode']} | {row['body']} | {on[0]:.2f} / {on[1]:.2f} | "
            f"{off[0]:.2f} / {off[1]:.2f} | {on[0] - off[0]:+.2f} |"
        )


if __name__ == "__main__":
    main()
