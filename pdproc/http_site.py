"""The metrics/health listener's socket: aiohttp's TCP site with a bound on connections.

aiohttp bounds how long a connection may sit without a whole request head (its
keepalive_timeout, armed from the connection's start), but not how many connections are
open at once. This site keeps at most `max_connections`: a new one beyond them closes the
oldest. So a flood of half-open connections cannot take the descriptors pdproc needs for
prefills (pdproc.limits), and cannot lock out a health probe either: the probe is the
newest connection and done in a few milliseconds, the flood's are the oldest.
"""

from __future__ import annotations

import asyncio

from aiohttp import web


class BoundedTCPSite(web.BaseSite):
    __slots__ = ("_host", "_max_connections", "_port", "_reuse_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        max_connections: int,
        reuse_port: bool,
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._reuse_port = reuse_port
        self._max_connections = max_connections

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        limit = self._max_connections

        def protocol() -> asyncio.Protocol:
            open_now = server.connections  # oldest first
            for oldest in open_now[: max(len(open_now) - limit + 1, 0)]:
                oldest.force_close()
            return server()

        self._server = await asyncio.get_running_loop().create_server(
            protocol,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
            reuse_port=self._reuse_port,
        )
