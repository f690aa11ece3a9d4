"""The ports pdproc listens on are its own: no other process may join them.

pdproc's worker processes (--workers) share their ports with SO_REUSEPORT. The kernel would
let any other process of the same user join them the same way, and spread connections over
both: a second pdproc started by mistake would silently take half of Envoy's streams and
half of the scrapes. So before anything binds, each fixed port is probed with a bind
*without* SO_REUSEPORT, which fails while anyone listens there (shared or not); only then do
pdproc's own workers bind with it. SO_REUSEADDR on the probe keeps a previous run's
TIME_WAIT connections from counting.

One race is left: another process binding between the probe and the workers' binds. A
single process (--workers 1) has none, as it binds without SO_REUSEPORT at all.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

from pdproc.targets import HostPort


class PortInUse(Exception):
    """A port pdproc is to listen on is held by another process."""


def port_held(host: str, port: int) -> bool:
    """True when something listens on host:port (also with SO_REUSEPORT)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # As gRPC and aiohttp bind "::": dual-stack, so an IPv4 holder counts too.
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                probe.bind(address)
            except OSError:
                return True
    return False


def check_ports_free(listeners: Iterable[tuple[HostPort | None, str]]) -> None:
    """Raise PortInUse for the first fixed port (of `listeners`: an address and the flag
    that sets it) another process listens on."""
    for listen, flag in listeners:
        if listen is None or listen.port == 0:
            continue
        if port_held(listen.host, listen.port):
            raise in_use(listen, flag)


def in_use(listen: HostPort, flag: str) -> PortInUse:
    """The refusal of a port another process holds (found by the probe, or by a bind)."""
    return PortInUse(
        f"{flag} {listen}: port {listen.port} is already in use by another process "
        "(another pdproc?); stop it or choose another port"
    )
