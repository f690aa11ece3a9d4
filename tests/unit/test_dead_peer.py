"""A pod whose node is gone is found by the kernel, not by the prefill timeout: every pod
connection bounds unacknowledged data and probes idle ones (pdproc.pod_http), and what
that bound ends in is the pod being down."""

from __future__ import annotations

import errno
import socket

import aiohttp
import pytest
from aiohttp import web

from pdproc.engine_maps import BootstrapError
from pdproc.outcomes import PrefillResult
from pdproc.pod_http import new_session, socket_factory
from pdproc.pod_verdict import Verdict, of_prefill
from pdproc.prefill import _client_failure

ADDR = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", 0))


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux only")
def test_pod_sockets_bound_a_silent_peer() -> None:
    with socket_factory(5.0)(ADDR) as sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 5000
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 5


def test_no_bound_leaves_the_kernels_defaults() -> None:
    with socket_factory(0.0)(ADDR) as sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0


async def test_the_session_connects_with_those_sockets() -> None:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        url = f"http://127.0.0.1:{port}/health"
        async with new_session(4, 5.0) as session, session.get(url) as response:
            assert response.status == 200
    finally:
        await runner.cleanup()


def test_a_peer_that_stopped_acknowledging_is_a_dead_peer_and_the_pod_is_down() -> None:
    # What aiohttp raises when the kernel drops a connection on TCP_USER_TIMEOUT.
    result, _ = _client_failure(aiohttp.ClientOSError(errno.ETIMEDOUT, "Connection timed out"))
    assert result is PrefillResult.DEAD_PEER
    assert of_prefill(result) is Verdict.DOWN


def test_a_reset_is_no_dead_peer() -> None:
    result, _ = _client_failure(aiohttp.ClientOSError(errno.ECONNRESET, "reset"))
    assert result is PrefillResult.ERROR


def test_a_failed_bootstrap_query_defaults_to_failed() -> None:
    assert BootstrapError("status 500").verdict is Verdict.FAILED
