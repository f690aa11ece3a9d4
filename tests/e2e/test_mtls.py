"""TLS and mTLS between Envoy and pdproc, through a real Envoy, with certificates made at run
time: `pdproc serve --tls-cert/--tls-key/--tls-client-ca` and `pdproc envoy-config
--processor-tls-ca/--processor-tls-cert/--processor-tls-key/--processor-sni`.

With the right certificates P/D works and Envoy's gRPC health check passes over TLS. With a
wrong one (a client certificate from another CA, none at all, a pdproc certificate Envoy does
not trust or that names another host) the handshake fails: Envoy then fails open (the decode
serves the request alone, and the kv guard still refuses client kv_transfer_params) or, with
--fail-closed, answers 500 and the decode receives nothing.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
from pdproc_sim.devstack import (
    Envoy,
    Process,
    SimPair,
    envoy_binary,
    free_port,
    http_get,
    port_open,
    scrape_metric,
    spawn,
    start_pdproc,
    start_sim,
    wait_for,
)

from pdproc.envoy_config import EnvoyOptions, render
from pdproc.targets import HostPort
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


@dataclass
class Pki:
    ca: str
    other_ca: str
    server_cert: str  # for 127.0.0.1 and pdproc.test
    server_key: str
    named_cert: str  # for pdproc.test only
    named_key: str
    client_cert: str
    client_key: str
    foreign_cert: str  # a client certificate from another CA
    foreign_key: str


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()

    def write(name: str, blob: trustme.Blob) -> str:
        path = folder / name
        blob.write_to_path(str(path))
        return str(path)

    server = ca.issue_cert("127.0.0.1", "pdproc.test")
    named = ca.issue_cert("pdproc.test")
    client = ca.issue_cert("envoy.test")
    foreign = other.issue_cert("envoy.test")
    return Pki(
        ca=write("ca.pem", ca.cert_pem),
        other_ca=write("other-ca.pem", other.cert_pem),
        server_cert=write("server.pem", server.cert_chain_pems[0]),
        server_key=write("server.key", server.private_key_pem),
        named_cert=write("named.pem", named.cert_chain_pems[0]),
        named_key=write("named.key", named.private_key_pem),
        client_cert=write("client.pem", client.cert_chain_pems[0]),
        client_key=write("client.key", client.private_key_pem),
        foreign_cert=write("foreign.pem", foreign.cert_chain_pems[0]),
        foreign_key=write("foreign.key", foreign.private_key_pem),
    )


@dataclass
class Backend:
    """The simulated pair and two mTLS pdprocs (certificate for the IP, or for a name)."""

    workdir: Path
    sim: SimPair
    pdproc: HostPort
    named_pdproc: HostPort
    metrics: HostPort
    processes: list[Process]

    def reset(self) -> None:
        for role in (self.sim.prefill, self.sim.decode):
            with httpx.Client(timeout=5) as client:
                client.post(role.url() + "/sim/faults", json={"clear": True})
                client.post(role.url() + "/sim/reset", json={})

    def records(self, role: str) -> list[dict[str, Any]]:
        url = (self.sim.prefill if role == "prefill" else self.sim.decode).url()
        found: list[dict[str, Any]] = httpx.get(url + "/sim/requests", timeout=5).json()["requests"]
        return found


@pytest.fixture(scope="module")
def backend(pki: Pki) -> Iterator[Backend]:
    with contextlib.ExitStack() as cleanup:
        workdir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="pdproc-tls-")))
        sim = start_sim(workdir, ["--dp-ranks", "2", "--itl-ms", "2"])
        cleanup.callback(sim.process.stop)
        common = ["--prefill-allow", "127.0.0.1/32"]
        common += ["--mooncake-bootstrap-port", str(sim.bootstrap.port)]
        common += ["--tls-client-ca", pki.ca]
        proc, addr, metrics = start_pdproc(
            workdir, [*common, "--tls-cert", pki.server_cert, "--tls-key", pki.server_key]
        )
        cleanup.callback(proc.stop)
        named, named_addr, _ = start_pdproc(
            workdir,
            [*common, "--tls-cert", pki.named_cert, "--tls-key", pki.named_key],
            name="pdproc-named",
        )
        cleanup.callback(named.stop)
        yield Backend(workdir, sim, addr, named_addr, metrics, [proc, named])


@contextlib.contextmanager
def envoy_for(
    backend: Backend, processor: HostPort, wait_healthy: bool, **options: Any
) -> Iterator[Envoy]:
    """An Envoy in front of `processor`; unlike devstack's, it can start without waiting for
    the processor to pass its health check (it never will with the wrong certificates)."""
    listen = HostPort("127.0.0.1", free_port())
    admin = HostPort("127.0.0.1", free_port())
    config = backend.workdir / f"envoy-{listen.port}.yaml"
    rendered = EnvoyOptions(
        listen=listen,
        processor=[processor],
        decode=[backend.sim.decode],
        admin=admin,
        access_log=True,
        **options,
    )
    config.write_text(render(rendered), "utf-8")
    argv = [envoy_binary(), "-c", str(config), "--use-dynamic-base-id", "--concurrency", "1",
            "--log-level", "warning", "--disable-hot-restart"]  # fmt: skip
    proc = spawn(f"envoy-{listen.port}", argv, backend.workdir)
    try:
        wait_for(lambda: http_get(admin.url() + "/ready")[0] == 200, "envoy", proc=proc)
        wait_for(lambda: port_open(listen.host, listen.port), "envoy listener", proc=proc)
        envoy = Envoy(proc, listen, admin, config)
        if wait_healthy:
            eventually(lambda: healthy(envoy) == 1, timeout_s=30)
        yield envoy
    finally:
        proc.stop()


def healthy(envoy: Envoy) -> int:
    return envoy.stats("cluster.pdproc.").get("cluster.pdproc.membership_healthy", 0)


def handshakes(envoy: Envoy) -> int:
    return envoy.stats("cluster.pdproc.").get("cluster.pdproc.ssl.handshake", 0)


def post(envoy: Envoy, backend: Backend, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        envoy.url + "/v1/chat/completions",
        json=body,
        headers={"x-prefiller-host-port": str(backend.sim.prefill)},
        timeout=30,
    )


def attack() -> dict[str, Any]:
    # Pointed at a closed loopback port: nothing may try it, and nothing would answer.
    params = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://127.0.0.1:9",
              "remote_engine_id": "x", "transfer_id": "t"}  # fmt: skip
    return {**CHAT, "kv_transfer_params": params}


@pytest.mark.parametrize("single_message", [False, True], ids=["two-message", "single-message"])
def test_pd_over_mtls(backend: Backend, pki: Pki, single_message: bool) -> None:
    backend.reset()
    tls = {"processor_tls_ca": pki.ca, "processor_tls_cert": pki.client_cert,
           "processor_tls_key": pki.client_key, "single_message": single_message}  # fmt: skip
    with envoy_for(backend, backend.pdproc, wait_healthy=True, **tls) as envoy:
        response = post(envoy, backend, CHAT)
        assert response.status_code == 200, response.text
        (decode,) = eventually(lambda: [r for r in backend.records("decode") if r["status"]])
        assert decode["body"]["kv_transfer_params"]["transfer_id"].startswith("xfer-")
        assert eventually(lambda: [r for r in backend.records("prefill") if r["status"]])
        assert handshakes(envoy) >= 1
        refused = post(envoy, backend, attack())
        assert refused.status_code == 400
        assert len(backend.records("decode")) == 1


def test_sni_names_pdproc_certificate(backend: Backend, pki: Pki) -> None:
    """pdproc's certificate names pdproc.test only: accepted when that is the expected
    name (--processor-sni), refused when Envoy expects the address it dials."""
    backend.reset()
    client = {"processor_tls_ca": pki.ca, "processor_tls_cert": pki.client_cert,
              "processor_tls_key": pki.client_key}  # fmt: skip
    with envoy_for(
        backend, backend.named_pdproc, wait_healthy=True, processor_sni="pdproc.test", **client
    ) as envoy:
        response = post(envoy, backend, CHAT)
        assert response.status_code == 200
        (decode,) = eventually(lambda: [r for r in backend.records("decode") if r["status"]])
        assert "kv_transfer_params" in decode["body"]
    with envoy_for(backend, backend.named_pdproc, wait_healthy=False, **client) as envoy:
        eventually(lambda: envoy.stats("cluster.pdproc.").get("cluster.pdproc.ssl.fail_verify_san"))
        assert healthy(envoy) == 0


REFUSALS = {
    "client certificate from another CA": "foreign",
    "no client certificate": "none",
    "pdproc's certificate from an untrusted CA": "untrusted",
}


def refused_options(pki: Pki, case: str) -> dict[str, Any]:
    if case == "foreign":
        return {"processor_tls_ca": pki.ca, "processor_tls_cert": pki.foreign_cert,
                "processor_tls_key": pki.foreign_key}  # fmt: skip
    if case == "none":
        return {"processor_tls_ca": pki.ca}
    return {"processor_tls_ca": pki.other_ca, "processor_tls_cert": pki.client_cert,
            "processor_tls_key": pki.client_key}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_handshake_fails_open_to_the_decode_alone(
    backend: Backend, pki: Pki, case: str
) -> None:
    backend.reset()
    served_before = _served(backend)
    options = refused_options(pki, REFUSALS[case])
    with envoy_for(backend, backend.pdproc, wait_healthy=False, **options) as envoy:
        eventually(lambda: _failed_health_checks(envoy) >= 1)
        assert healthy(envoy) == 0
        assert handshakes(envoy) == 0
        response = post(envoy, backend, CHAT)
        assert response.status_code == 200, response.text
        (decode,) = backend.records("decode")
        assert "kv_transfer_params" not in decode["body"]  # no P/D: pdproc was not reached
        assert backend.records("prefill") == []
        # The kv guard stands in for pdproc: client params are refused all the same.
        assert post(envoy, backend, attack()).status_code == 400
        assert len(backend.records("decode")) == 1
        assert envoy.stats("http.ingress.ext_proc.")["http.ingress.ext_proc.failure_mode_allowed"]
    assert _served(backend) == served_before  # pdproc never answered a stream


def test_refused_handshake_fails_closed_with_fail_closed(backend: Backend, pki: Pki) -> None:
    backend.reset()
    options = {**refused_options(pki, "foreign"), "failure_mode_allow": False}
    with envoy_for(backend, backend.pdproc, wait_healthy=False, **options) as envoy:
        eventually(lambda: _failed_health_checks(envoy) >= 1)
        response = post(envoy, backend, CHAT)
        assert response.status_code == 500
        assert backend.records("decode") == []
        assert backend.records("prefill") == []


def _failed_health_checks(envoy: Envoy) -> int:
    return envoy.stats("cluster.pdproc.").get("cluster.pdproc.health_check.failure", 0)


def _served(backend: Backend) -> float:
    return scrape_metric(backend.metrics, "pdproc_requests_total")
