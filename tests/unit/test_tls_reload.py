"""TLS files reloaded while serving: a real grpc.aio server on loopback, files laid out as a
mounted Kubernetes Secret (`tls.crt` -> `..data/tls.crt`, `..data` -> a timestamped folder,
swapped by one rename), and fresh TLS handshakes that report the served certificate."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import trustme
from cryptography import x509
from grpc_health.v1 import health, health_pb2_grpc

from pdproc.metrics import Metrics
from pdproc.tls_reload import BadTlsFiles, TlsFiles, TlsReloader, parse_material
from tests.secret_volume import MountedSecret


class Secret(MountedSecret):
    """The Secret volume pdproc reads its TLS files from."""

    def files(self, client_ca: bool = True) -> TlsFiles:
        ca = str(self.root / "ca.crt") if client_ca else None
        return TlsFiles(str(self.root / "tls.crt"), str(self.root / "tls.key"), ca)


def leaf_files(cert: trustme.LeafCert, ca: trustme.CA) -> dict[str, bytes]:
    chain = b"".join(blob.bytes() for blob in cert.cert_chain_pems)
    return {
        "tls.crt": chain,
        "tls.key": cert.private_key_pem.bytes(),
        "ca.crt": ca.cert_pem.bytes(),
    }


def serial_of(cert: trustme.LeafCert) -> int:
    return x509.load_pem_x509_certificate(cert.cert_chain_pems[0].bytes()).serial_number


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@pytest.fixture
def secret(tmp_path: Path) -> Secret:
    return Secret(tmp_path)


class Served:
    def __init__(self, port: int, server_ca: trustme.CA, client: trustme.LeafCert) -> None:
        self.port, self.server_ca, self.client = port, server_ca, client

    def _handshake(self) -> int:
        context = ssl.create_default_context()
        self.server_ca.configure_trust(context)
        self.client.configure_cert(context)
        context.set_alpn_protocols(["h2"])
        with (
            socket.create_connection(("127.0.0.1", self.port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            der = tls.getpeercert(binary_form=True)
            assert der is not None
            return x509.load_der_x509_certificate(der).serial_number

    def _talks(self) -> bool:
        # TLS 1.3: the server's refusal of a client certificate reaches the client after
        # its side of the handshake, at the first read; an accepted one gets HTTP/2 SETTINGS.
        try:
            context = ssl.create_default_context()
            self.server_ca.configure_trust(context)
            self.client.configure_cert(context)
            context.set_alpn_protocols(["h2"])
            with (
                socket.create_connection(("127.0.0.1", self.port), timeout=10) as raw,
                context.wrap_socket(raw, server_hostname="localhost") as tls,
            ):
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                return len(tls.recv(9)) > 0
        except (ssl.SSLError, ConnectionError):
            return False

    async def accepted(self) -> bool:
        """Whether a fresh connection with the client certificate is served."""
        return await asyncio.to_thread(self._talks)

    async def serial(self) -> int:
        """The serial of the certificate a fresh handshake gets."""
        return await asyncio.to_thread(self._handshake)


CA = trustme.CA()
CLIENT = CA.issue_cert("envoy.test")


@pytest.fixture
async def served(secret: Secret) -> AsyncIterator[tuple[Served, TlsReloader, Metrics]]:
    secret.publish(leaf_files(CA.issue_cert("localhost"), CA))
    metrics = Metrics()
    reloader = TlsReloader(secret.files(), 3600, metrics.tls_loaded)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", reloader.credentials())
    await server.start()
    try:
        yield Served(port, CA, CLIENT), reloader, metrics
    finally:
        await server.stop(0)
        await reloader.stop()


async def test_a_swapped_secret_is_served_from_the_next_handshake(
    served: tuple[Served, TlsReloader, Metrics], secret: Secret
) -> None:
    tls, reloader, metrics = served
    first = reloader.material.serial
    assert await tls.serial() == first
    renewed = CA.issue_cert("localhost")
    secret.publish(leaf_files(renewed, CA))
    assert await tls.serial() == first  # not checked yet: the old one stays
    await reloader.check()
    assert await tls.serial() == serial_of(renewed) != first
    assert sample(metrics, "pdproc_tls_reloads_total", outcome="ok") == 1
    expiry = sample(
        metrics, "pdproc_tls_certificate_expiry_timestamp_seconds", certificate="served"
    )
    assert expiry == reloader.material.not_after
    await reloader.check()  # unchanged files: nothing to do
    assert sample(metrics, "pdproc_tls_reloads_total", outcome="ok") == 1


@pytest.mark.parametrize("damage", ["key of another certificate", "not PEM", "CA not PEM"])
async def test_a_bad_new_set_keeps_the_old_one_and_is_counted_once(
    served: tuple[Served, TlsReloader, Metrics], secret: Secret, damage: str
) -> None:
    tls, reloader, metrics = served
    first = reloader.material.serial
    files = leaf_files(CA.issue_cert("localhost"), CA)
    if damage == "key of another certificate":
        files["tls.key"] = CA.issue_cert("other").private_key_pem.bytes()
    elif damage == "not PEM":
        files["tls.crt"] = b"-----BEGIN CERTIFICATE-----\nnot base64\n"
    else:
        files["ca.crt"] = b"garbage"
    secret.publish(files)
    await reloader.check()
    await reloader.check()
    assert await tls.serial() == first
    assert sample(metrics, "pdproc_tls_reloads_total", outcome="error") == 1
    assert sample(metrics, "pdproc_tls_reloads_total", outcome="ok") is None
    good = CA.issue_cert("localhost")
    secret.publish(leaf_files(good, CA))  # the next good set is taken
    await reloader.check()
    assert await tls.serial() == serial_of(good)


async def test_a_rotated_away_client_ca_refuses_new_handshakes(
    served: tuple[Served, TlsReloader, Metrics], secret: Secret
) -> None:
    tls, reloader, metrics = served
    assert await tls.accepted()
    new_ca = trustme.CA()
    files = leaf_files(CA.issue_cert("localhost"), CA)
    files["ca.crt"] = new_ca.cert_pem.bytes()  # clients of the old CA are no longer trusted
    secret.publish(files)
    await reloader.check()
    assert not await tls.accepted()
    ca_expiry = sample(
        metrics, "pdproc_tls_certificate_expiry_timestamp_seconds", certificate="client_ca"
    )
    assert ca_expiry == reloader.material.client_ca_not_after


def test_parse_material_reads_serial_and_expiry() -> None:
    cert = CA.issue_cert("localhost")
    files = leaf_files(cert, CA)
    material = parse_material(files["tls.crt"], files["tls.key"], files["ca.crt"])
    parsed = x509.load_pem_x509_certificate(files["tls.crt"])
    assert material.serial == parsed.serial_number
    assert material.not_after == parsed.not_valid_after_utc.timestamp()
    with pytest.raises(BadTlsFiles, match="not the key"):
        parse_material(files["tls.crt"], CLIENT.private_key_pem.bytes(), None)


def test_unusable_files_at_start_are_an_error(secret: Secret) -> None:
    files = leaf_files(CA.issue_cert("localhost"), CA)
    files["tls.key"] = b"nope"
    secret.publish(files)
    with pytest.raises(BadTlsFiles, match="--tls-key"):
        TlsReloader(secret.files(), 5, Metrics().tls_loaded)
