"""A prefill pod whose node goes silent (packets dropped, nothing refused) is found by the
dead-peer bound, not by the prefill timeout, and costs only the request in flight on it.

The bed runs in a network namespace this test creates (`unshare -n`: its own loopback,
nothing outside it touched) with nftables dropping one pod's packets; it needs root (or
user namespaces) and nft, and is skipped without them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bed_possible() -> bool:
    if shutil.which("unshare") is None or shutil.which("nft") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "nft", "list", "tables"], capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _bed_possible(), reason="needs unshare -n and nft")


def test_a_silent_pod_costs_at_most_the_requests_in_flight_on_it() -> None:
    run = subprocess.run(
        ["unshare", "-n", sys.executable, "-m", "tests.integration.dead_peer_bed", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = orjson.loads(run.stdout.strip().splitlines()[-1])
    print(result)  # the measured seconds, for whoever reads -s
    statuses = [r["status"] for r in result["requests"]]
    assert 0 not in statuses  # every request was answered
    failed = [s for s in statuses if s != 200]
    assert len(failed) <= 3, statuses
    assert statuses[-20:] == [200] * 20  # once found down, the pod costs nothing more
    assert result["prefills"]["dead_peer"] >= 1  # found by the bound...
    assert result["prefills"]["timeout"] == 0  # ...not by --prefill-timeout (60 s)
    assert result["second_open"]
