"""The metrics/health listener's socket: aiohttp's TCP site with bounds on connections.

aiohttp (before 3.14) never drops a connection that has not sent a whole request head, and
bounds neither how long a connection lives nor how many are open. This site:

- closes each connection `lifetime_s` after it opened, once its current request (if any)
  is answered (aiohttp's graceful `close()`), and whatever it does CLOSE_GRACE_S later: a
  half-sent request head is dropped then, an honest scraper just opens a new connection;
- keeps at most `max_connections`: a new one beyond them closes the oldest at once. So a
  flood of half-open connections cannot take the descriptors pdproc needs for prefills
  (pdproc.limits), and cannot lock out a health probe either: the probe is the newest
  connection and done in a few milliseconds, the flood's are the oldest.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

# Time a connection past its lifetime has to finish the answer it is getting.
CLOSE_GRACE_S = 5.0


class BoundedTCPSite(web.BaseSite):
    __slots__ = ("_host", "_lifetime_s", "_max_connections", "_port", "_reuse_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        max_connections: int,
        lifetime_s: float,
        reuse_port: bool,
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._reuse_port = reuse_port
        self._max_connections = max_connections
        self._lifetime_s = lifetime_s

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        limit = self._max_connections
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:
            open_now = server.connections  # oldest first
            for oldest in open_now[: max(len(open_now) - limit + 1, 0)]:
                oldest.force_close()
            handler = server()
            loop.call_later(self._lifetime_s, handler.close)
            # close() leaves a connection that never sent a whole request head open.
            loop.call_later(self._lifetime_s + CLOSE_GRACE_S, handler.force_close)
            return handler

        self._server = await loop.create_server(
            protocol,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
            reuse_port=self._reuse_port,
        )
