"""HTTP to the prefill pods: one pooled client, and reads that never exceed a bound.

A pod inside the allow list is trusted to be a pod, not to behave: what pdproc reads of
its answers is bounded, and nothing it sends (a redirect, an endless body) is followed.

A pod whose node died or dropped off the network answers nothing, not even a reset: with
no bound a prefill sent to it waits its whole `--prefill-timeout`. Every pod connection
therefore bounds how long the peer may leave what was sent unacknowledged
(`TCP_USER_TIMEOUT`) and probes an idle or waiting connection (TCP keepalive), so a dead
peer is found in `--dead-peer-timeout` seconds plus one. The kernel acknowledges for a pod
however long its compute takes (a long prompt's prefill included), so only a node that is
gone trips it, and the prefill ends `dead_peer`: the pod is down.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable

import aiohttp
from aiohappyeyeballs import AddrInfoType

_CHUNK = 64 * 1024
# Connections beyond --max-prefill-connections for bootstrap queries and health probes, so
# they do not make a prefill that holds one of its slots (pdproc.slots) wait in the pool.
CONTROL_CONNECTIONS = 64
# pdproc itself out of descriptors, buffers or memory: says nothing about the pod.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def locally_exhausted(exc: BaseException) -> bool:
    """True when `exc` (or what it wraps) is pdproc's own resource exhaustion (EMFILE:
    "Too many open files", ENFILE, ENOBUFS, ENOMEM), never to be held against a pod."""
    seen: BaseException | None = exc
    for _ in range(4):  # aiohttp wraps the OSError once or twice
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in _EXHAUSTED:
            return True
        wrapped = getattr(seen, "os_error", None)
        if isinstance(wrapped, OSError) and wrapped.errno in _EXHAUSTED:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# What a connection whose peer stopped acknowledging fails with (ETIMEDOUT: the user
# timeout or the keepalive probes expired; the others: a router says the node is gone).
_PEER_GONE = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN})
KEEPALIVE_IDLE_S = 1


def peer_gone(exc: BaseException) -> bool:
    """True when an exchange failed because the peer stopped acknowledging (its node is
    dead or cut off), not because it answered badly or closed the connection."""
    return isinstance(exc, OSError) and exc.errno in _PEER_GONE


def bound_dead_peer(sock: socket.socket, dead_peer_s: float) -> None:
    """Have the kernel drop `sock` once its peer leaves data unacknowledged, or keepalive
    probes unanswered, for `dead_peer_s` seconds (0: no bound)."""
    if dead_peer_s <= 0:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux (and recent macOS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, round(dead_peer_s)))
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux: also bounds unacknowledged data
        sock.setsockopt(
            socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(dead_peer_s * 1000))
        )


def socket_factory(dead_peer_s: float) -> Callable[[AddrInfoType], socket.socket]:
    """Sockets for pod connections, each with the dead-peer bound."""

    def make(addr_info: AddrInfoType) -> socket.socket:
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        try:
            bound_dead_peer(sock, dead_peer_s)
        except OSError:
            sock.close()
            raise
        return sock

    return make


# How long an idle connection to a pod is kept for reuse: below the 5 s after which vLLM's
# (and SGLang's) HTTP server, uvicorn, closes an idle keep-alive connection. Reusing one the
# pod is closing fails the prefill with a disconnect the pod did not cause.
POD_KEEPALIVE_S = 4.0


def new_session(max_connections: int, dead_peer_s: float = 0.0) -> aiohttp.ClientSession:
    """The client for bootstrap queries and prefills (aiohttp rather than httpx: a third of
    the CPU per request, measured with py-spy on the benchmark)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=max_connections,
            limit_per_host=0,
            keepalive_timeout=POD_KEEPALIVE_S,
            socket_factory=socket_factory(dead_peer_s),
        ),
        # Pod-to-pod traffic: never route it through an HTTP(S)_PROXY from the environment.
        trust_env=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
        # Answers are only checked: no need to decompress anything.
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
    )


async def read_at_most(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The body up to `limit` bytes, plus one byte more when there is more (so callers can
    tell a body of exactly `limit` bytes from a longer one)."""
    parts: list[bytes] = []
    left = limit + 1
    while left > 0:
        chunk = await content.read(min(left, _CHUNK))
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


async def discard(content: aiohttp.StreamReader, limit: int) -> None:
    """Read and drop up to `limit` bytes; stop early at the end of the body."""
    left = limit
    while left > 0:
        chunk = await content.read(min(left, _CHUNK))
        if not chunk:
            return
        left -= len(chunk)
