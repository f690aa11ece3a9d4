"""A prefill pod restarts with new engine ids: no request is lost, in any process of any
replica, even when nothing warned pdproc (the pod got no traffic while it was down).

The simulated decode behaves like vLLM's: told an engine id its pod no longer has, it waits
silently for its abort timeout (`--kv-timeout-s`, 480 s in vLLM, 5 s here so a failure shows
as a 500 rather than a hang). The simulator restarts at once; a real engine takes 30 s and
more, which is what the test's idle spell stands for.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from pdproc_sim.devstack import (
    Process,
    Stack,
    running_stack,
    scrape_metric,
    start_envoy,
    start_pdproc,
)

from pdproc.config import Settings
from pdproc.server import RESTART_S
from pdproc.targets import HostPort
from tests.waiting import eventually

from .conftest import one_stream_per_connection

pytestmark = pytest.mark.e2e

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
REPLICAS = 2
WORKERS = 2
MAX_REQUESTS = 400  # bound of each loop below
HELD = 6


def prefilled(processes: list[Process], since: float) -> list[dict[str, Any]]:
    """The "pd request prefilled" log lines (pid, engine id) of every pdproc process, from
    `since` (a wall-clock time) on."""
    lines = []
    for process in processes:
        for line in process.log_path.read_text().splitlines():
            if line.startswith("{") and '"pd request prefilled"' in line:
                entry = orjson.loads(line)
                if entry["ts"] >= since:
                    lines.append(entry)
    return lines


def engine_ids(lines: list[dict[str, Any]]) -> set[str]:
    return {line["engine_id"] for line in lines}


def serve_until_every_process_served(
    url: str, target: dict[str, str], replicas: list[Process], since: float
) -> set[int]:
    """Requests (at most MAX_REQUESTS), each of them served, until every process of every
    replica has prefilled one since `since`; their pids."""
    pids: set[int] = set()
    with httpx.Client(timeout=60) as client:
        for _ in range(MAX_REQUESTS):
            response = client.post(url + "/v1/chat/completions", json=CHAT, headers=target)
            assert response.status_code == 200, response.text
            pids = {line["pid"] for line in prefilled(replicas, since)}
            if len(pids) == REPLICAS * WORKERS:
                return pids
    raise AssertionError(f"only processes {pids} got requests")


def restart_with_requests_in_flight(st: Stack, url: str, target: dict[str, str]) -> list[Any]:
    """HELD requests held in the prefill, the pod restarted under them; their answers."""

    def post() -> httpx.Response:
        return httpx.post(url + "/v1/chat/completions", json=CHAT, headers=target, timeout=60)

    st.sim_post("prefill", "/sim/faults", {"prefill_hang": True})
    with ThreadPoolExecutor(HELD) as pool:
        held = [pool.submit(post) for _ in range(HELD)]
        eventually(lambda: st.sim_get("prefill", "/sim/stats")["in_flight"] == HELD)
        st.sim_post("prefill", "/sim/restart")
        st.sim_post("prefill", "/sim/faults", {"clear": True})
        return [answer.result() for answer in held]


def failed_requests(metrics: list[HostPort]) -> float:
    """pdproc_requests_total{outcome="prefill_failed"} over the replicas."""
    return sum(
        scrape_metric(address, "pdproc_requests_total", outcome="prefill_failed")
        for address in metrics
    )


def test_a_restarted_pod_costs_no_request_in_any_worker_or_replica(tmp_path: Path) -> None:
    """2 replicas x --workers 2, each process with its own engine-id cache and the default
    --engine-cache-ttl: every process pairs with the old ids before the restart, and after
    it (the pod idle longer than the ttl, as a real restart is) every request, in every
    process, gets the new ids and its KV. Then a restart with requests in flight: those
    fail, loudly, and no other."""
    # A real restart takes RESTART_S and more; the test waits just past the ttl, the
    # shortest downtime the design has to hold for.
    downtime = Settings().engine_cache_ttl + 0.5
    assert downtime < RESTART_S
    with running_stack(
        ["--dp-ranks", "2", "--kv-timeout-s", "5"],
        ["--workers", str(WORKERS)],
        workdir=tmp_path,
    ) as st:
        replicas = [st.pdproc]
        second, second_addr, second_metrics = start_pdproc(
            tmp_path, st.pdproc_args, name="pdproc-2"
        )
        st.extra.append(second)
        replicas.append(second)
        envoy = start_envoy(
            tmp_path,
            [st.sim.decode],
            [st.pdproc_addr, second_addr],
            config_hook=one_stream_per_connection,
        )
        st.extra.append(envoy.process)
        target = {"x-prefiller-host-port": str(st.sim.prefill)}
        old_ids = set(st.sim_get("prefill", "/sim/stats")["engine_ids"].values())
        metrics = [st.metrics_addr, second_metrics]

        serve_until_every_process_served(envoy.url, target, replicas, 0.0)
        assert engine_ids(prefilled(replicas, 0.0)) <= old_ids

        new_ids = set(st.sim_post("prefill", "/sim/restart")["engine_ids"].values())
        assert not new_ids & old_ids
        time.sleep(downtime)  # no traffic, so no failure warns any process

        st.sim_post("decode", "/sim/reset")
        since = time.time()
        serve_until_every_process_served(envoy.url, target, replicas, since)
        after = prefilled(replicas, since)
        assert engine_ids(after) <= new_ids
        decodes = st.sim_get("decode", "/sim/stats")
        assert decodes["kv_failures"] == {}
        assert decodes["kv_ok"] == len(after)

        # A restart with requests in flight: exactly those fail, with pdproc's 502 (their
        # prefill failed, so their decode was aborted, not left waiting), counted.
        answers = restart_with_requests_in_flight(st, envoy.url, target)
        assert [answer.status_code for answer in answers] == [502] * HELD
        assert {answer.headers["x-pdproc-error"] for answer in answers} == {"prefill_failed"}
        assert failed_requests(metrics) == HELD
        time.sleep(downtime)
        since = time.time()
        serve_until_every_process_served(envoy.url, target, replicas, since)
        assert engine_ids(prefilled(replicas, since)) <= set(
            st.sim_get("prefill", "/sim/stats")["engine_ids"].values()
        )
        assert failed_requests(metrics) == HELD


def test_a_pod_that_restarted_too_fast_and_failed_once_is_followed_by_every_worker(
    tmp_path: Path,
) -> None:
    """The restart the bound does not cover: the pod is back with new ids at once, and its
    first prefill fails in one worker. Before, the other worker kept its young, stale map
    (about 1 run in 5 failed); now the workers tell each other, and no request after that
    failure is lost."""
    with running_stack(
        ["--dp-ranks", "2", "--kv-timeout-s", "5"],
        ["--workers", str(WORKERS)],
        workdir=tmp_path,
        envoy_config_hook=one_stream_per_connection,
    ) as st:
        target = {"x-prefiller-host-port": str(st.sim.prefill)}

        def post() -> httpx.Response:
            url = st.envoy.url + "/v1/chat/completions"
            return httpx.post(url, json=CHAT, headers=target, timeout=60)

        def serve_until_every_worker_served(since: float) -> None:
            pids: set[int] = set()
            for _ in range(MAX_REQUESTS):
                response = post()
                assert response.status_code == 200, response.text
                pids = {line["pid"] for line in prefilled([st.pdproc], since)}
                if len(pids) == WORKERS:
                    return
            raise AssertionError(f"only processes {pids} got requests")

        serve_until_every_worker_served(0.0)
        time.sleep(1.1)  # a map younger than a second survives failures (they come in bursts)
        new_ids = set(st.sim_post("prefill", "/sim/restart")["engine_ids"].values())
        st.sim_post("prefill", "/sim/faults", {"prefill_status": 500})
        assert post().status_code == 502
        st.sim_post("prefill", "/sim/faults", {"clear": True})
        st.sim_post("decode", "/sim/reset")
        since = time.time()
        serve_until_every_worker_served(since)
        assert {line["engine_id"] for line in prefilled([st.pdproc], since)} <= new_ids
        assert st.sim_get("decode", "/sim/stats")["kv_failures"] == {}
