"""Scale-out: prefill pods found through DNS, and two pdproc replicas behind one Envoy."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from pdproc_sim.devstack import Stack, running_stack, scrape_metric, start_envoy, start_pdproc

pytestmark = pytest.mark.e2e

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


def test_prefill_pool_from_dns(tmp_path: Path) -> None:
    """No endpoint picker, no static pool: `--prefill-dns localhost:PORT` finds the pod.
    The name is resolved by the system resolver, as a headless Service name would be."""
    with running_stack(["--dp-ranks", "2"], workdir=tmp_path) as st:
        proc, addr, _ = start_pdproc(
            tmp_path,
            ["--prefill-dns", f"localhost:{st.sim.prefill.port}", "--dns-refresh", "1",
             "--mooncake-bootstrap-port", str(st.sim.bootstrap.port)],
            name="pdproc-dns",
        )  # fmt: skip
        st.extra.append(proc)
        envoy = start_envoy(tmp_path, [st.sim.decode], [addr])
        st.extra.append(envoy.process)
        for _ in range(4):
            response = httpx.post(envoy.url + "/v1/chat/completions", json=CHAT, timeout=30)
            assert response.status_code == 200
        decodes = st.sim_get("decode", "/sim/requests")["requests"]
        assert len(decodes) == 4
        for decode in decodes:
            kv = decode["body"]["kv_transfer_params"]
            assert kv["remote_bootstrap_addr"] == f"http://127.0.0.1:{st.sim.bootstrap.port}"
            assert decode["kv"]["shipped"] is True


def test_two_replicas_behind_one_envoy_share_the_work(tmp_path: Path) -> None:
    """Any replica serves any request: the only state is each one's engine-id cache."""
    with running_stack(["--dp-ranks", "2"], workdir=tmp_path) as st:
        second, second_addr, second_metrics = start_pdproc(
            tmp_path, st.pdproc_args, name="pdproc-2"
        )
        st.extra.append(second)
        envoy = start_envoy(tmp_path, [st.sim.decode], [st.pdproc_addr, second_addr])
        st.extra.append(envoy.process)
        target = {"x-prefiller-host-port": str(st.sim.prefill)}
        with httpx.Client(timeout=30) as client:
            for _ in range(40):
                response = client.post(
                    envoy.url + "/v1/chat/completions", json=CHAT, headers=target
                )
                assert response.status_code == 200
        first_pd = st.metric("pdproc_requests_total", outcome="pd")
        second_pd = scrape_metric(second_metrics, "pdproc_requests_total", outcome="pd")
        assert first_pd + second_pd == 40
        assert first_pd > 0
        assert second_pd > 0
        # Each replica queried the bootstrap server for itself.
        assert st.sim_get("prefill", "/sim/stats")["bootstrap_queries"] >= 2


def post_pd_requests(st: Stack, count: int) -> None:
    target = {"x-prefiller-host-port": str(st.sim.prefill)}
    with httpx.Client(timeout=30) as client:
        for _ in range(count):
            response = client.post(st.envoy.url + "/v1/chat/completions", json=CHAT, headers=target)
            assert response.status_code == 200


def assert_counted_pd(st: Stack, count: int) -> None:
    """The shared page counts `count` P/D requests (once both workers counted theirs)."""
    deadline = time.monotonic() + 15
    while st.metric("pdproc_requests_total", outcome="pd") < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert st.metric("pdproc_requests_total", outcome="pd") == count


def assert_every_family_on_the_shared_page(st: Stack) -> None:
    """What one process's page has, the shared page has too: every family (with or
    without samples), the build info, and the workers' process metrics added up."""
    page = st.metrics_text()
    types = {line.split()[2] for line in page.splitlines() if line.startswith("# TYPE")}
    for family in (
        "pdproc_requests_total",
        "pdproc_decode_aborts_total",
        "pdproc_prefill_breaker_open",
        "pdproc_build_info",
        "python_info",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_start_time_seconds",
    ):
        assert family in types, family
    assert st.metric("pdproc_build_info") == 1
    assert st.metric("process_cpu_seconds_total") > 0


def test_workers_share_one_port_and_one_metrics_page(tmp_path: Path) -> None:
    """`--workers 2`: two processes behind one port; /metrics adds up both; SIGTERM drains."""
    with running_stack(["--itl-ms", "1"], ["--workers", "2"], workdir=tmp_path) as st:
        post_pd_requests(st, 30)
        assert_counted_pd(st, 30)
        assert_every_family_on_the_shared_page(st)
        started = [
            line for line in st.pdproc.log_path.read_text().splitlines() if "pdproc serving" in line
        ]
        assert len(started) == 2  # both workers are up on the same port
        assert st.pdproc.stop() == 0


class _Tarpit:
    """A listener that accepts and never answers (a bootstrap server that hangs)."""

    def __init__(self, host: str, port: int) -> None:
        self._listener = socket.create_server((host, port))
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._held.append(conn)

    def close(self) -> None:
        self._listener.close()
        for conn in self._held:
            conn.close()
        self._thread.join(timeout=5)


def test_a_pool_member_whose_bootstrap_hangs_costs_no_request(tmp_path: Path) -> None:
    """Through the real Envoy: of two pool members, the second's bootstrap server accepts and
    never answers. Every request is served by P/D on the first: a request placed on the
    second moves once its query times out, nothing having been sent to it."""
    with running_stack(["--dp-ranks", "2"], workdir=tmp_path) as st:
        boot = st.sim.bootstrap.port
        hung = _Tarpit("127.0.0.2", boot)
        try:
            second = f"127.0.0.2:{st.sim.prefill.port}"
            proc, addr, metrics = start_pdproc(
                tmp_path,
                # The hung member first: a picker that prefers the first of equals hits it.
                ["--prefill", second, "--prefill", str(st.sim.prefill), "--bootstrap-timeout", "1",
                 "--mooncake-bootstrap-port", str(boot),
                 # turns reach the hanging member whatever the prompt (the prefix policy
                 # would keep this one repeated prompt on its home)
                 "--pool-policy", "least-loaded"],
                name="pdproc-pool",
            )  # fmt: skip
            st.extra.append(proc)
            envoy = start_envoy(tmp_path, [st.sim.decode], [addr])
            st.extra.append(envoy.process)
            with httpx.Client(timeout=30) as client:
                for _ in range(12):
                    response = client.post(envoy.url + "/v1/chat/completions", json=CHAT)
                    assert response.status_code == 200, response.text
            decodes = st.sim_get("decode", "/sim/requests")["requests"]
            assert len(decodes) == 12
            for decode in decodes:
                kv = decode["body"]["kv_transfer_params"]
                assert kv["remote_bootstrap_addr"] == f"http://127.0.0.1:{boot}"
            assert scrape_metric(metrics, "pdproc_bootstrap_reroutes_total") >= 1
        finally:
            hung.close()
