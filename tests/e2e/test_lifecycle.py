"""Processor lifecycle through a real Envoy: graceful shutdown, processor down and back,
IPv6 end to end, and the decode-only policy."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdproc_sim.devstack import http_get, running_stack, start_pdproc

from tests.waiting import eventually

pytestmark = pytest.mark.e2e

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def post(url: str, target: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={**CHAT, **extra},
        headers={"x-prefiller-host-port": target},
        timeout=60,
    )


def test_sigterm_drains_in_flight_prefills_then_exits_0(tmp_path: Path) -> None:
    with running_stack(["--itl-ms", "5"], ["--shutdown-delay", "0.5"], workdir=tmp_path) as st:
        st.sim_post("prefill", "/sim/faults", {"prefill_hang": True})
        result: dict[str, httpx.Response] = {}
        client = threading.Thread(
            target=lambda: result.update(r=post(st.envoy.url, str(st.sim.prefill)))
        )
        client.start()
        eventually(lambda: st.metric("pdproc_prefills_in_flight") == 1)

        st.pdproc.popen.send_signal(signal.SIGTERM)
        eventually(lambda: http_get(st.metrics_addr.url() + "/readyz")[0] == 503)
        # The held request is still in flight; nothing is cut while draining.
        assert st.pdproc.popen.poll() is None
        st.sim_post("prefill", "/sim/faults", {"prefill_hang": False})
        client.join(60)
        assert result["r"].status_code == 200
        assert st.pdproc.popen.wait(30) == 0
        log = st.pdproc.log_path.read_text()
        assert "pd request prefilled" in log
        assert '"abandoned_prefills":0' in log


def test_processor_down_serves_decode_only_and_resumes(tmp_path: Path) -> None:
    with running_stack(["--itl-ms", "5"], workdir=tmp_path) as st:
        target = str(st.sim.prefill)
        assert post(st.envoy.url, target).status_code == 200
        st.pdproc.stop()
        # failure_mode_allow: true in the shipped config: the decode does it all alone.
        response = post(st.envoy.url, target)
        assert response.status_code == 200
        last = st.sim_get("decode", "/sim/requests")["requests"][-1]
        assert "kv_transfer_params" not in last["body"]
        assert (
            st.envoy.stats("http.ingress.ext_proc.")["http.ingress.ext_proc.failure_mode_allowed"]
            >= 1
        )

        # pdproc comes back on the same address: P/D resumes.
        proc, _, _ = start_pdproc(
            tmp_path, st.pdproc_args, "pdproc-again", listen=st.pdproc_addr, metrics=st.metrics_addr
        )
        st.extra.append(proc)

        def paired() -> bool:
            response = post(st.envoy.url, target)
            body = st.sim_get("decode", "/sim/requests")["requests"][-1]["body"]
            return response.status_code == 200 and "kv_transfer_params" in body

        eventually(paired, timeout_s=30)


def test_ipv6_end_to_end(tmp_path: Path) -> None:
    with running_stack(["--dp-ranks", "2"], workdir=tmp_path, host="::1") as st:
        response = post(st.envoy.url, str(st.sim.prefill))
        assert response.status_code == 200
        decode = st.sim_get("decode", "/sim/requests")["requests"][-1]
        kv = decode["body"]["kv_transfer_params"]
        assert kv["remote_bootstrap_addr"] == f"http://[::1]:{st.sim.bootstrap.port}"
        assert decode["kv"]["shipped"] is True


def test_decode_only_policy_when_bootstrap_fails(tmp_path: Path) -> None:
    pdproc = ["--on-bootstrap-error", "decode-only"]
    with running_stack(["--itl-ms", "5"], pdproc, workdir=tmp_path) as st:
        st.sim_post("prefill", "/sim/faults", {"bootstrap": "down"})
        response = post(st.envoy.url, str(st.sim.prefill))
        assert response.status_code == 200
        decode = st.sim_get("decode", "/sim/requests")["requests"][-1]
        assert "kv_transfer_params" not in decode["body"]
        assert st.metric("pdproc_requests_total", outcome="decode_only") == 1
        # A client's own params are refused, not forwarded, on this path too.
        refused = post(st.envoy.url, str(st.sim.prefill), kv_transfer_params={"x": 1})
        assert refused.status_code == 400
        assert len(st.sim_get("decode", "/sim/requests")["requests"]) == 1
        assert st.sim_get("prefill", "/sim/requests")["requests"] == []
