"""Certificate rotation through a real Envoy, the way Kubernetes rotates a mounted Secret:
the kubelet writes the new files into a fresh timestamped folder and swaps the `..data`
symlink to it in one rename (the file names are symlinks through `..data`).

pdproc runs mTLS with `--tls-reload 0.5 --tls-max-connection-age 2`, so a rotation reaches
Envoy's long-lived HTTP/2 connection within the test. Certificates are made at run time:
CA-A and CA-B; pdproc's first certificate is an RSA key from CA-A and its renewal an ECDSA
key from CA-B with a later not-after, so three independent witnesses tell which one a
handshake got: the serial a handshake of the test's own reads, Envoy's `ssl.sigalgs.*`
counters (the peer's signature algorithm follows its key type) and pdproc's expiry gauge.

- Server certificate rotated mid-load: every request of a paced load answers 200 and is
  P/D (pdproc counts each as `pd`, the decode got kv_transfer_params, Envoy failed none
  open), the reload is counted, and every handshake after it, the test's and Envoy's, gets
  the new certificate.
- Client CA rotated to CA-B (revoking Envoy's CA-A certificate): a stream in flight on the
  old connection finishes as P/D, while new streams are refused by the TLS handshake; Envoy
  fails those open (the decode serves the request alone, no P/D), as it does for any
  unreachable pdproc (`failure_mode_allow`, the generated config's default).
- The server rotation with `--workers 2`: each worker process reloads (the reload counter
  sums to two, the expiry gauge, the minimum over live workers, is the new not-after, and
  every fresh handshake, spread over both workers by the kernel, gets the new certificate).
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import ssl
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
from cryptography import x509
from pdproc_sim.devstack import (
    Envoy,
    SimPair,
    scrape_metric,
    start_envoy,
    start_pdproc,
    start_sim,
)

from pdproc.targets import HostPort
from tests.secret_volume import MountedSecret
from tests.waiting import eventually

from .conftest import one_stream_per_connection

pytestmark = pytest.mark.e2e

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
TLS_ARGS = ("--tls-reload", "0.5", "--tls-max-connection-age", "2")
# Bounds of the load loop: the least it sends, what it sends once Envoy has re-handshaken
# with the new certificate, and the most it may send whatever happens.
LOAD_MIN, LOAD_AFTER, LOAD_MAX = 200, 50, 2000
# How long a rotation may take to reach Envoy (a bound on a hang, not a measurement).
ROTATED_S = 30.0
# Envoy's count of streams that had to wait for a new connection to pdproc (the ext_proc
# pool's; the health check has a connection of its own).
POOLED = "cluster.pdproc.upstream_rq_pending_total"
HANDSHAKES = "cluster.pdproc.ssl.handshake"
# Envoy's count of streams that waited for a connection that then failed.
EJECTED = "cluster.pdproc.upstream_rq_pending_failure_eject"
# HTTP/2's client preface and an empty SETTINGS frame: a server that accepted the handshake
# answers with its own SETTINGS; one that refused the client certificate sends an alert.
H2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@dataclass(frozen=True)
class Leaf:
    cert: bytes
    key: bytes
    serial: int
    not_after: float


@dataclass(frozen=True)
class Pki:
    folder: Path
    ca_a: bytes
    ca_b: bytes
    server_a: Leaf  # RSA, CA-A
    server_b: Leaf  # ECDSA, CA-B, expires later
    client_a: Leaf  # Envoy's
    client_b: Leaf

    def file(self, name: str, data: bytes) -> str:
        path = self.folder / name
        path.write_bytes(data)
        return str(path)


def _leaf(ca: trustme.CA, *names: str, days: int, key: trustme.KeyType) -> Leaf:
    now = datetime.datetime.now(datetime.UTC)
    issued = ca.issue_cert(*names, not_after=now + datetime.timedelta(days=days), key_type=key)
    cert = issued.cert_chain_pems[0].bytes()
    parsed = x509.load_pem_x509_certificate(cert)
    return Leaf(
        cert,
        issued.private_key_pem.bytes(),
        parsed.serial_number,
        parsed.not_valid_after_utc.timestamp(),
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca_a, ca_b = trustme.CA(), trustme.CA()
    return Pki(
        folder=tmp_path_factory.mktemp("pki"),
        ca_a=ca_a.cert_pem.bytes(),
        ca_b=ca_b.cert_pem.bytes(),
        server_a=_leaf(ca_a, "127.0.0.1", days=30, key=trustme.KeyType.RSA),
        server_b=_leaf(ca_b, "127.0.0.1", days=90, key=trustme.KeyType.ECDSA),
        client_a=_leaf(ca_a, "envoy.test", days=30, key=trustme.KeyType.ECDSA),
        client_b=_leaf(ca_b, "envoy.test", days=30, key=trustme.KeyType.ECDSA),
    )


def secret_files(server: Leaf, client_ca: bytes) -> dict[str, bytes]:
    return {"tls.crt": server.cert, "tls.key": server.key, "ca.crt": client_ca}


@dataclass
class Rig:
    """The simulated pair, pdproc serving the mounted Secret, Envoy in front."""

    sim: SimPair
    secret: MountedSecret
    pdproc: HostPort
    metrics: HostPort
    envoy: Envoy

    def metric(self, name: str, **labels: str) -> float:
        return scrape_metric(self.metrics, name, **labels)

    def sim_post(self, role: str, path: str, payload: dict[str, Any]) -> None:
        url = (self.sim.prefill if role == "prefill" else self.sim.decode).url()
        httpx.post(url + path, json=payload, timeout=5).raise_for_status()

    def records(self, role: str) -> list[dict[str, Any]]:
        url = (self.sim.prefill if role == "prefill" else self.sim.decode).url()
        found: list[dict[str, Any]] = httpx.get(url + "/sim/requests", timeout=5).json()["requests"]
        return found

    def post(self, client: httpx.Client, prefill: bool = True) -> httpx.Response:
        """A chat completion through Envoy; `prefill=False` names no prefill pod, so pdproc
        (when reached) passes it through without touching the simulated prefill."""
        headers = {"x-prefiller-host-port": str(self.sim.prefill)} if prefill else {}
        return client.post(
            self.envoy.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60
        )

    def envoy_stat(self, name: str) -> int:
        return self.envoy.stats(name).get(name, 0)

    def sigalgs(self, family: str) -> int:
        """Envoy's handshakes with pdproc whose peer signed with a `family` key (rsa, ecdsa)."""
        prefix = f"cluster.pdproc.ssl.sigalgs.{family}"
        return sum(self.envoy.stats(prefix).values())


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimPair]:
    pair = start_sim(tmp_path_factory.mktemp("sim"), ["--dp-ranks", "2", "--itl-ms", "2"])
    try:
        yield pair
    finally:
        pair.process.stop()


@contextlib.contextmanager
def rig(
    sim: SimPair,
    pki: Pki,
    files: dict[str, bytes],
    envoy_ca: bytes,
    extra: tuple[str, ...] = (),
    config_hook: Callable[[dict[str, Any]], None] | None = None,
) -> Iterator[Rig]:
    with contextlib.ExitStack() as cleanup:
        workdir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="pdproc-rot-")))
        for role in ("prefill", "decode"):
            for path, payload in (("/sim/faults", {"clear": True}), ("/sim/reset", {})):
                url = (sim.prefill if role == "prefill" else sim.decode).url()
                httpx.post(url + path, json=payload, timeout=5).raise_for_status()
        secret = MountedSecret(workdir / "secret")
        secret.publish(files)
        args = ["--prefill-allow", "127.0.0.1/32", "--mooncake-bootstrap-port",
                str(sim.bootstrap.port), "--tls-cert", secret.path("tls.crt"), "--tls-key",
                secret.path("tls.key"), "--tls-client-ca", secret.path("ca.crt"), *TLS_ARGS,
                *extra]  # fmt: skip
        proc, addr, metrics = start_pdproc(workdir, args)
        cleanup.callback(proc.stop)
        tls = {"processor_tls_ca": pki.file(f"envoy-ca-{addr.port}.pem", envoy_ca),
               "processor_tls_cert": pki.file("envoy.pem", pki.client_a.cert),
               "processor_tls_key": pki.file("envoy.key", pki.client_a.key)}  # fmt: skip
        envoy = start_envoy(
            workdir, [sim.decode], [addr], extra_options=tls, config_hook=config_hook
        )
        cleanup.callback(envoy.process.stop)
        yield Rig(sim, secret, addr, metrics, envoy)


@dataclass
class Handshake:
    accepted: bool  # pdproc took the client certificate and spoke HTTP/2
    serial: int  # of the certificate pdproc presented
    error: str = ""


def handshake(target: HostPort, pki: Pki, client: Leaf) -> Handshake:
    """A fresh TLS connection to pdproc from the test itself, presenting `client`."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=(pki.ca_a + pki.ca_b).decode())
    name = f"client-{client.serial:x}"
    context.load_cert_chain(
        pki.file(name + ".pem", client.cert), pki.file(name + ".key", client.key)
    )
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((target.host, target.port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=target.host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        serial = x509.load_der_x509_certificate(der).serial_number
        # TLS 1.3: the server judges the client's certificate after the client's side of the
        # handshake is done, so the verdict is the first read.
        try:
            tls.sendall(H2_HELLO)
            answer = tls.recv(9)
        except (ssl.SSLError, OSError) as exc:
            return Handshake(False, serial, str(exc))
        return Handshake(bool(answer), serial, "" if answer else "closed")


class Load:
    """Paced requests through Envoy on a thread, each answer's status and P/D kept: at least
    LOAD_MIN, then LOAD_AFTER more once `settle()` is called, never more than LOAD_MAX."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop_at = LOAD_MAX
        self._settled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tls-load", daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop_at = 0
        self._thread.join(120)
        assert not self._thread.is_alive(), "the load thread did not stop"

    def settle(self) -> None:
        """Send LOAD_AFTER more (and at least LOAD_MIN in all), then stop."""
        self._stop_at = max(LOAD_MIN, len(self.statuses) + LOAD_AFTER)
        self._settled.set()

    def wait(self) -> list[int]:
        self._thread.join(300)
        assert not self._thread.is_alive(), "the load did not finish within its bound"
        return self.statuses

    def _run(self) -> None:
        with httpx.Client() as client:
            while len(self.statuses) < min(self._stop_at, LOAD_MAX):
                try:
                    self.statuses.append(self.rig.post(client).status_code)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    self.statuses.append(0)
                self._settled.wait(0.005)


def pd_served(rig: Rig) -> float:
    return rig.metric("pdproc_requests_total", outcome="pd")


def reloads(rig: Rig) -> float:
    return rig.metric("pdproc_tls_reloads_total", outcome="ok")


def decode_answers(rig: Rig) -> list[dict[str, Any]]:
    return [r for r in rig.records("decode") if r["status"] is not None]


def failed_open(rig: Rig) -> int:
    return rig.envoy_stat("http.ingress.ext_proc.failure_mode_allowed")


@dataclass
class Before:
    """Counters read before a rotation."""

    pd: float
    failed_open: int
    handshakes: int

    @classmethod
    def read(cls, rig: Rig) -> Before:
        return cls(pd_served(rig), failed_open(rig), rig.envoy_stat(HANDSHAKES))


def rotate_server_under_load(rig: Rig, pki: Pki, workers: int) -> dict[str, Any]:
    """The server certificate rotated (CA-A RSA -> CA-B ECDSA) while a load runs; the
    numbers seen, for the report."""
    assert handshake(rig.pdproc, pki, pki.client_a).serial == pki.server_a.serial
    assert rig.sigalgs("ecdsa") == 0  # nothing but the RSA certificate served so far
    before = Before.read(rig)
    with Load(rig) as load:
        eventually(lambda: len(load.statuses) >= LOAD_MIN // 4, ROTATED_S, what="load started")
        rotated_at = len(load.statuses)
        rig.secret.publish(secret_files(pki.server_b, pki.ca_a))
        rsa_after_reload = await_new_certificate_in_envoy(rig, workers)
        new_cert_at = len(load.statuses)
        load.settle()
        statuses = load.wait()
    assert load.errors == []
    assert statuses == [200] * len(statuses)
    assert rotated_at < new_cert_at < len(statuses)  # the rotation happened mid-load
    assert_all_pd(rig, before, len(statuses))
    # After the reload every handshake gets the new certificate: Envoy's (no RSA signature
    # since) and fresh ones of the test's.
    assert rig.sigalgs("rsa") == rsa_after_reload
    assert_serving(rig, pki, pki.server_b, workers)
    return {
        "requests": len(statuses),
        "rotated_at": rotated_at,
        "envoy_new_cert_at": new_cert_at,
        "envoy_pool_connections": rig.envoy_stat(POOLED),
        "envoy_handshakes": rig.envoy_stat(HANDSHAKES) - before.handshakes,
        "envoy_rsa": rig.sigalgs("rsa"),
        "envoy_ecdsa": rig.sigalgs("ecdsa"),
        "reloads": reloads(rig),
    }


def await_new_certificate_in_envoy(rig: Rig, workers: int) -> int:
    """Wait until every worker reloaded and Envoy's ext_proc pool has opened a connection
    since; Envoy's count of RSA signatures then (none may follow)."""
    eventually(lambda: reloads(rig) >= workers, ROTATED_S, what="every worker reloaded")
    eventually(lambda: rig.sigalgs("ecdsa") > 0, ROTATED_S, what="envoy re-handshaken")
    rsa_after_reload, pooled = rig.sigalgs("rsa"), rig.envoy_stat(POOLED)
    # The health check's connection may have been the one re-handshaken: go on until the
    # ext_proc streams' pool has had to open a connection since.
    eventually(lambda: rig.envoy_stat(POOLED) > pooled, ROTATED_S, what="pool reconnected")
    return rsa_after_reload


def assert_all_pd(rig: Rig, before: Before, sent: int) -> None:
    """Every request P/D: pdproc counted each as `pd`, the decode got kv_transfer_params for
    each, and Envoy opened every stream (none failed open to the decode alone)."""
    assert eventually(lambda: pd_served(rig) - before.pd >= sent, 10)
    assert pd_served(rig) - before.pd == sent
    answered = eventually(lambda: (a := decode_answers(rig)) and len(a) >= sent and a)
    assert len(answered) == sent
    assert all("kv_transfer_params" in r["body"] for r in answered)
    assert failed_open(rig) == before.failed_open
    assert rig.envoy_stat("http.ingress.ext_proc.streams_failed") == 0


def assert_serving(rig: Rig, pki: Pki, leaf: Leaf, workers: int) -> None:
    """Every worker reloaded once and serves `leaf`: the counter sums the workers, the expiry
    gauge is the minimum over them, and fresh handshakes (the kernel picks the worker) all
    get it."""
    assert reloads(rig) == workers
    served = rig.metric("pdproc_tls_certificate_expiry_timestamp_seconds", certificate="served")
    assert served == leaf.not_after
    fresh = [handshake(rig.pdproc, pki, pki.client_a) for _ in range(8 * workers)]
    assert {h.serial for h in fresh} == {leaf.serial}
    assert all(h.accepted for h in fresh)


def test_server_certificate_rotated_mid_load(sim: SimPair, pki: Pki) -> None:
    files = secret_files(pki.server_a, pki.ca_a)
    # Envoy trusts both CAs through the rotation, as a CA change is rolled out.
    with rig(sim, pki, files, envoy_ca=pki.ca_a + pki.ca_b) as r:
        seen = rotate_server_under_load(r, pki, workers=1)
    print("server rotation:", seen)


def test_server_certificate_rotated_in_every_worker(sim: SimPair, pki: Pki) -> None:
    files = secret_files(pki.server_a, pki.ca_a)
    # A connection per request: the kernel spreads Envoy's handshakes over both workers.
    with rig(
        sim,
        pki,
        files,
        envoy_ca=pki.ca_a + pki.ca_b,
        extra=("--workers", "2"),
        config_hook=one_stream_per_connection,
    ) as r:
        seen = rotate_server_under_load(r, pki, workers=2)
    print("server rotation, two workers:", seen)


class Held:
    """A request through Envoy whose prefill the simulated pod holds until released."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.responses: list[httpx.Response] = []
        self._thread = threading.Thread(target=self._send, name="held-request")

    def __enter__(self) -> Held:
        self.rig.sim_post("prefill", "/sim/faults", {"prefill_hang": True})
        self._thread.start()
        in_flight = lambda: [p for p in self.rig.records("prefill") if p["status"] is None]  # noqa: E731
        eventually(in_flight, what="the held prefill")
        return self

    def __exit__(self, *_: object) -> None:
        self.rig.sim_post("prefill", "/sim/faults", {"clear": True})
        self._thread.join(60)
        assert not self._thread.is_alive(), "the held request did not finish once released"

    def in_flight(self) -> bool:
        return self._thread.is_alive()

    def _send(self) -> None:
        with httpx.Client() as client:
            self.responses.append(self.rig.post(client))


def await_refusal(rig: Rig, client: httpx.Client, failed_before: int) -> list[int]:
    """Probe through Envoy until a new stream is refused (Envoy fails it open); the probes'
    statuses. A probe names no prefill pod, so one that still reached pdproc is not held."""
    probes = []

    def refused() -> bool:
        probes.append(rig.post(client, prefill=False).status_code)
        return failed_open(rig) > failed_before

    eventually(refused, ROTATED_S, every_s=0.2, what="new streams refused")
    return probes


def assert_refused(rig: Rig, pki: Pki, ejected_before: int) -> None:
    """The CA-A client certificate is refused, a CA-B one accepted; in Envoy a stream waited
    for a new connection, which failed, while the held one stays on the old connection."""
    assert not handshake(rig.pdproc, pki, pki.client_a).accepted
    assert handshake(rig.pdproc, pki, pki.client_b).accepted
    assert rig.envoy_stat(EJECTED) > ejected_before
    assert rig.envoy_stat("cluster.pdproc.upstream_rq_active") == 1


def test_client_ca_rotated_away_stops_new_streams_not_those_in_flight(
    sim: SimPair, pki: Pki
) -> None:
    files = secret_files(pki.server_a, pki.ca_a)
    with rig(sim, pki, files, envoy_ca=pki.ca_a) as r, httpx.Client() as client:
        assert handshake(r.pdproc, pki, pki.client_a).accepted
        assert not handshake(r.pdproc, pki, pki.client_b).accepted
        assert r.post(client).status_code == 200  # Envoy's connection is up, P/D works
        before, ejected_before = Before.read(r), r.envoy_stat(EJECTED)
        with Held(r) as held:
            r.secret.publish(secret_files(pki.server_a, pki.ca_b))
            eventually(lambda: reloads(r) >= 1, ROTATED_S, what="the client CA reloaded")
            # Envoy's connection is asked to go away, the new one is refused, and Envoy
            # fails the request open (the decode serves it alone).
            probes = await_refusal(r, client, before.failed_open)
            assert set(probes) == {200}
            assert_refused(r, pki, ejected_before)
            assert held.in_flight()  # the refusals came while it was in flight
        # The stream in flight on the old connection finished, as P/D.
        assert [h.status_code for h in held.responses] == [200]
        assert eventually(lambda: pd_served(r) > before.pd, 10)
        assert pd_served(r) == before.pd + 1
        pd_answers = [a for a in decode_answers(r) if "kv_transfer_params" in a["body"]]
        assert len(pd_answers) == 2  # the first request and the held one
        print(
            "client CA rotation:",
            {
                "probes": len(probes),
                "failed_open": failed_open(r) - before.failed_open,
                "ejected": r.envoy_stat(EJECTED) - ejected_before,
                "connect_fail": r.envoy_stat("cluster.pdproc.upstream_cx_connect_fail"),
                "reloads": reloads(r),
            },
        )
