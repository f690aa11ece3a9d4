"""Prefill targets: parsing `host:port` values and deciding which ones may be used.

Pure logic, no I/O. A target comes either from the operator (the static pool) or from the
`x-prefiller-host-port` request header, which an endpoint picker sets but a client can forge:
only allowed targets are ever contacted (SSRF protection).
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from pdproc.errors import shown

PREFILL_HEADER = "x-prefiller-host-port"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class TargetError(ValueError):
    """A `host:port` value that cannot be a prefill target."""


class HostPort(NamedTuple):
    """A pod's address. A tuple, not a dataclass: it keys every per-pod table and is hashed
    and compared some thirty times per request, which a tuple does in C."""

    host: str  # without IPv6 brackets
    port: int

    @property
    def ip(self) -> IPAddress | None:
        return _ip_of(self.host)

    @property
    def url_host(self) -> str:
        """The host as it must appear in a URL: IPv6 literals need brackets."""
        return f"[{self.host}]" if ":" in self.host else self.host

    def url(self, port: int | None = None) -> str:
        return f"http://{self.url_host}:{self.port if port is None else port}"

    def __str__(self) -> str:
        return f"{self.url_host}:{self.port}"


@functools.lru_cache(maxsize=4096)
def _ip_of(host: str) -> IPAddress | None:
    """The host as an IP address (None for a name). Asked for every request's target, and
    the pods are few: parsed once each (bounded, as a header may name any host)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


_PORT = re.compile(r"[0-9]{1,5}")
# A DNS name or an IPv4 literal, in ASCII: anything else is not a pod address (and must not
# reach a URL, a log line or a metric label).
_HOST = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})")


def parse_host_port(value: str) -> HostPort:
    """Parse `host:port`, `[v6]:port` (as Go's net.JoinHostPort writes it) or `http://...`.

    Any text gives a HostPort or a TargetError (never another exception): header values
    are client input."""
    text = value.strip()
    if text.startswith("http://"):
        text = text[len("http://") :]
    text = text.rstrip("/")
    split = _split_bracketed if text.startswith("[") else _split_named
    host, port_text = split(text, value)
    if not _PORT.fullmatch(port_text) or not 0 < int(port_text) < 65536:
        raise TargetError(f"invalid prefill target {shown(value)}: bad port")
    return HostPort(host.lower(), int(port_text))


def _split_bracketed(text: str, value: str) -> tuple[str, str]:
    """`[v6]:port` -> (the IPv6 address, written canonically, the port's text)."""
    end = text.find("]")
    if end < 0 or not text[end + 1 :].startswith(":"):
        raise TargetError(f"invalid prefill target {shown(value)}: expected [ipv6]:port")
    host, port_text = text[1:end], text[end + 2 :]
    try:
        if "%" in host:
            raise ValueError("zone ids are not pod addresses")
        address = ipaddress.IPv6Address(host)
    except ValueError:
        raise TargetError(f"invalid prefill target {shown(value)}: bad IPv6 address") from None
    return str(address), port_text


def _split_named(text: str, value: str) -> tuple[str, str]:
    """`host:port` (a DNS name or an IPv4 address) -> (host, the port's text)."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise TargetError(f"invalid prefill target {shown(value)}: expected host:port")
    if ":" in host:
        raise TargetError(f"invalid prefill target {shown(value)}: IPv6 needs brackets")
    if not _HOST.fullmatch(host):
        raise TargetError(f"invalid prefill target {shown(value)}: bad host")
    return host, port_text


def target_from_header(values: Iterable[str]) -> HostPort | None:
    """The prefill target named by `x-prefiller-host-port`, or None when it names none.

    Like llm-d's sidecar: a comma list (in one or several header values) takes its first
    non-empty entry; None when no entry names anything (the picker reads that as "no
    disaggregation"). A malformed entry raises.
    """
    for value in values:
        for entry in value.split(","):
            if entry.strip():
                return parse_host_port(entry)
    return None


@dataclass(frozen=True, slots=True)
class AllowList:
    """Which header-named prefill targets may be contacted.

    Entries are CIDRs (an IP literal target must fall in one), host names (exact,
    case-insensitive; never resolved, so DNS cannot be used to smuggle a target in) or `*`.
    Any port on an allowed host is allowed, as in llm-d. Pool members are always allowed.
    """

    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = frozenset()
    allow_all: bool = False

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        allow_all = False
        for raw in entries:
            entry = raw.strip().lower()
            if not entry:
                continue
            if entry == "*":
                allow_all = True
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                if any(c.isspace() or c in "/:[]" for c in entry):
                    raise TargetError(f"invalid --prefill-allow entry {shown(raw)}") from None
                hosts.add(entry)
        return cls(tuple(networks), frozenset(hosts), allow_all)

    def allows(self, target: HostPort) -> bool:
        if self.allow_all:
            return True
        ip = target.ip
        if ip is None:
            return target.host in self.hosts
        return any(ip.version == net.version and ip in net for net in self.networks)
