"""The ext_proc port's TLS files, reloaded when they change: no restart for a rotated Secret.

cert-manager renews a certificate well before it expires and the kubelet swaps the mounted
Secret's `..data` symlink; a server that read its files once keeps the old certificate until
every handshake fails. So the files are read again every `--tls-reload` seconds (a few small
reads: no inotify, which misses symlink swaps on some volumes anyway), and a changed set that
parses and whose key matches its certificate becomes the configuration of the next
handshakes: gRPC's dynamic server credentials ask `_fetch` on every handshake. Established
connections and their streams are not touched.

A set that does not load (half written, key of another certificate, not PEM) keeps the old
configuration; it is logged and counted once per distinct content, and tried again at the
next check. Connections live at most `--tls-max-connection-age` (then a graceful GOAWAY:
streams in flight finish, Envoy opens a new connection), so a client CA rotated away stops
new streams within that bound, not only new connections.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    PublicFormat,
    load_pem_private_key,
)

log = logging.getLogger(__name__)


class BadTlsFiles(ValueError):
    """The files do not make a usable TLS configuration (the reason is the message)."""


@dataclass(frozen=True)
class TlsFiles:
    cert: str
    key: str
    client_ca: str | None = None

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """The chain's, the key's and the CA's bytes now (through `..data` at each open)."""
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), ca


@dataclass(frozen=True)
class TlsMaterial:
    chain: bytes
    key: bytes
    client_ca: bytes | None
    serial: int
    not_after: float  # of the served (leaf) certificate, Unix seconds
    client_ca_not_after: float | None  # the earliest of the client CA bundle

    @property
    def digest(self) -> str:
        return _digest(self.chain, self.key, self.client_ca)


def _digest(chain: bytes, key: bytes, client_ca: bytes | None) -> str:
    h = hashlib.sha256()
    for part in (chain, key, client_ca or b""):
        h.update(len(part).to_bytes(8, "big") + part)
    return h.hexdigest()


def parse_material(chain: bytes, key: bytes, client_ca: bytes | None) -> TlsMaterial:
    """Check the PEM bytes make a TLS configuration; BadTlsFiles says why not."""
    try:
        certificates = x509.load_pem_x509_certificates(chain)
    except ValueError as exc:
        raise BadTlsFiles(f"--tls-cert: no PEM certificate chain ({exc})") from None
    try:
        private = load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:
        raise BadTlsFiles(f"--tls-key: no unencrypted PEM private key ({exc})") from None
    leaf = certificates[0]
    if _spki(leaf.public_key()) != _spki(private.public_key()):
        raise BadTlsFiles("--tls-key is not the key of --tls-cert's first certificate")
    ca_not_after = None
    if client_ca is not None:
        try:
            authorities = x509.load_pem_x509_certificates(client_ca)
        except ValueError as exc:
            raise BadTlsFiles(f"--tls-client-ca: no PEM certificates ({exc})") from None
        ca_not_after = min(c.not_valid_after_utc.timestamp() for c in authorities)
    return TlsMaterial(
        chain, key, client_ca, leaf.serial_number, leaf.not_valid_after_utc.timestamp(),
        ca_not_after,
    )  # fmt: skip


def _spki(public_key: object) -> bytes:
    return public_key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)  # type: ignore[attr-defined, no-any-return]


def _configuration(material: TlsMaterial) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(material.key, material.chain)], root_certificates=material.client_ca
    )


# Told `start`, then of each check that found changed files, `ok` or `error` (rejected),
# with the material the next handshakes get.
Observer = Callable[[str, TlsMaterial], None]


class TlsReloader:
    def __init__(self, files: TlsFiles, interval_s: float, observe: Observer) -> None:
        """Load the files now: at start a bad set is an error (BadTlsFiles, OSError)."""
        self._files = files
        self._interval_s = interval_s
        self._observe = observe
        self.material = parse_material(*files.read())
        self._seen = self.material.digest  # the last content checked, good or bad
        # Set from the event loop, taken by gRPC's handshake threads: one reference swap.
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self._task: asyncio.Task[None] | None = None
        observe("start", self.material)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            _configuration(self.material),
            self._fetch,
            require_client_authentication=self._files.client_ca is not None,
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # None: keep the configuration gRPC has. Called before every handshake, so cheap.
        pending, self._pending = self._pending, None
        return pending

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="tls-reload")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.check()

    async def check(self) -> None:
        """Read the files; serve them from the next handshake on if they changed and load."""
        try:
            chain, key, ca = await asyncio.to_thread(self._files.read)
        except OSError as exc:
            self._reject(f"unreadable:{exc}", str(exc))
            return
        digest = _digest(chain, key, ca)
        if digest == self._seen:
            return
        try:
            material = parse_material(chain, key, ca)
        except BadTlsFiles as exc:
            self._reject(digest, str(exc))
            return
        self._seen = digest
        self.material = material
        self._pending = _configuration(material)
        self._observe("ok", material)
        log.info(
            "TLS files changed: serving the new certificate from the next handshake",
            extra={"serial": f"{material.serial:x}", "not_after": material.not_after},
        )

    def _reject(self, seen: str, why: str) -> None:
        if seen == self._seen:
            return  # told already
        self._seen = seen
        self._observe("error", self.material)
        log.warning("TLS files not reloaded, keeping the previous ones: %s", why)
