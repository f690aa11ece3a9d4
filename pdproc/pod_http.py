"""HTTP to the prefill pods: one pooled client, and reads that never exceed a bound.

A pod inside the allow list is trusted to be a pod, not to behave: what pdproc reads of
its answers is bounded, and nothing it sends (a redirect, an endless body) is followed.
"""

from __future__ import annotations

import errno

import aiohttp

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


def new_session(max_connections: int) -> aiohttp.ClientSession:
    """The client for bootstrap queries and prefills (aiohttp rather than httpx: a third of
    the CPU per request, measured with py-spy on the benchmark)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=max_connections, limit_per_host=0, keepalive_timeout=60
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
