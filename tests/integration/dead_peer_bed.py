"""Run inside a private network namespace (`unshare -n`, see test_dead_peer.py): two
simulated prefill pods on 127.0.0.1 and 127.0.0.2, a real pdproc pooling them, and the
second pod's node cut off silently (nftables drops its packets both ways, as a dead node or
a partition does: no reset, no refusal). Prints one JSON line: what each request ended as
and how long it took (measured, for the report; the test asserts outcomes only)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import replace

import orjson
from pdproc_sim import PrefillConfig, start_prefill

from pdproc.config import PoolPolicy
from pdproc.server import Server
from pdproc.targets import HostPort
from tests.envoy_side import Pdproc

from .harness import base_settings

REQUESTS = 30


def nft(*commands: str) -> None:
    for command in commands:
        subprocess.run(["nft", command], check=True)


async def main(dead_peer_s: float) -> None:
    first = await start_prefill(PrefillConfig(host="127.0.0.1", dp_ranks=1))
    second = await start_prefill(
        PrefillConfig(host="127.0.0.2", dp_ranks=1, bootstrap_port=first.bootstrap_port)
    )
    members = (HostPort("127.0.0.1", first.port), HostPort("127.0.0.2", second.port))
    settings = replace(
        base_settings(first),
        prefill=members,
        # Turns reach the silent pod whatever the prompt (the prefix policy would keep this
        # one repeated prompt on its home, which may be the other pod).
        pool_policy=PoolPolicy.LEAST_LOADED,
        prefill_timeout=60.0,
        bootstrap_timeout=1.0,
        dead_peer_timeout=dead_peer_s,
    )
    server = Server(settings)
    await server.start()
    pd = Pdproc(server)
    results: list[dict[str, object]] = []
    try:
        for _ in range(4):  # both pods warm: kept-alive connections, cached engine maps
            await pd.play()
        nft(
            "add table inet bed",
            "add chain inet bed in { type filter hook input priority 0; }",
            "add chain inet bed out { type filter hook output priority 0; }",
            "add rule inet bed in ip saddr 127.0.0.2 drop",
            "add rule inet bed out ip daddr 127.0.0.2 drop",
        )
        for _ in range(REQUESTS):
            started = time.monotonic()
            try:
                outcome = await pd.play()
                status = outcome.status if outcome.disaggregated else -outcome.status
            except (TimeoutError, AssertionError):
                status = 0  # no answer within the harness's read bound
            results.append({"status": status, "s": round(time.monotonic() - started, 2)})
        prefills = {
            result: pd.sample("pdproc_prefills_total", outcome=result)
            for result in ("2xx", "timeout", "dead_peer", "connect_error", "error")
        }
        second_open = server.service.breakers.is_open(members[1]) if server.service else None
    finally:
        await pd.stop(drain_timeout_s=1)
        await first.close()
        await second.close()
    line = {"requests": results, "prefills": prefills, "second_open": second_open}
    print(orjson.dumps(line).decode(), flush=True)


if __name__ == "__main__":
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    asyncio.run(main(float(sys.argv[1])))
