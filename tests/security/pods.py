"""A hostile prefill pod: a real aiohttp server on 127.0.0.1 playing a vLLM prefill pod (its
OpenAI port) and its Mooncake bootstrap server (its own port), each answer chosen by the test.

A pod inside pdproc's allow list is trusted to be a pod, not to behave: these behaviours are
what a compromised or buggy pod can send (redirects, endless bodies, huge engine maps, error
bodies quoting the prompt). Every behaviour is bounded here, so a pdproc that does not
defend itself makes a test fail, never hang.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from pdproc.targets import HostPort

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CHUNK = 64 * 1024
MiB = 1024 * 1024
# Nothing a test streams may take longer than this, whatever the client does.
STREAM_DEADLINE_S = 60.0


@dataclass
class Streamed:
    """What one streamed answer did: bytes handed to the socket, and whether the client
    closed the connection before the server had written everything it meant to."""

    sent: int = 0
    disconnected: bool = False
    finished: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Seen:
    """One request the pod received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class HostilePod:
    """Two listening sockets on 127.0.0.1: the prefill pod (`port`) and its bootstrap
    server (`bootstrap_port`). `on_query` and `on_prefill` are replaceable per test."""

    def __init__(self, engine_id: str = "e0") -> None:
        self.engine_id = engine_id
        self.on_query: Handler = engine_map({"0": {"engine_id": engine_id}})
        self.on_prefill: Handler = ok_prefill()
        self.hits: Counter[str] = Counter()  # "query", "prefill", or "other:<path>"
        self.seen: list[Seen] = []
        self.streams: list[Streamed] = []
        self.port = 0
        self.bootstrap_port = 0
        self._runners: list[web.AppRunner] = []

    @property
    def address(self) -> str:
        """The `x-prefiller-host-port` value naming this pod."""
        return f"127.0.0.1:{self.port}"

    def host_port(self) -> HostPort:
        """The pod as pdproc names a prefill target."""
        return HostPort("127.0.0.1", self.port)

    @property
    def total_hits(self) -> int:
        return sum(self.hits.values())

    def prefills(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "POST"]

    async def start(self) -> HostilePod:
        self.port = await self._serve(self._prefill_entry)
        self.bootstrap_port = await self._serve(self._bootstrap_entry)
        return self

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()

    async def _serve(self, entry: Handler) -> int:
        # A prompt can be megabytes; aiohttp's 1 MiB default would answer 413 itself.
        app = web.Application(client_max_size=256 * MiB)
        app.router.add_route("*", "/{tail:.*}", entry)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runners.append(runner)
        for address in runner.addresses:
            return int(address[1])
        raise RuntimeError("no address")

    async def _record(self, request: web.Request) -> None:
        body = await request.read()
        headers = {name.lower(): value for name, value in request.headers.items()}
        self.seen.append(Seen(request.method, request.path, headers, body))

    async def _prefill_entry(self, request: web.Request) -> web.StreamResponse:
        self.hits["prefill" if request.method == "POST" else f"other:{request.path}"] += 1
        await self._record(request)
        return await self.on_prefill(request)

    async def _bootstrap_entry(self, request: web.Request) -> web.StreamResponse:
        self.hits["query" if request.path == "/query" else f"other:{request.path}"] += 1
        await self._record(request)
        return await self.on_query(request)

    # Behaviours that need the pod's own bookkeeping.

    def streaming(
        self,
        chunks: Callable[[], Iterator[bytes]],
        max_bytes: int,
        status: int = 200,
        interval_s: float = 0.0,
    ) -> Handler:
        """Answer `status`, then write the chunks (one per `interval_s`) until the client
        hangs up, the chunks run out or `max_bytes` have been written; what happened is
        appended to `streams`."""

        async def handler(request: web.Request) -> web.StreamResponse:
            report = Streamed()
            self.streams.append(report)
            response = web.StreamResponse(
                status=status, headers={"content-type": "application/json"}
            )
            try:
                async with asyncio.timeout(STREAM_DEADLINE_S):
                    await response.prepare(request)
                    for chunk in chunks():
                        if report.sent >= max_bytes:
                            break
                        await response.write(chunk)
                        report.sent += len(chunk)
                        if interval_s:
                            await asyncio.sleep(interval_s)
            except (ConnectionError, TimeoutError):
                report.disconnected = True
            except asyncio.CancelledError:
                report.disconnected = True
                raise
            finally:
                report.finished.set()
            if report.disconnected:
                return response
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
            return response

        return handler


def engine_map(answer: object) -> Handler:
    """A Mooncake bootstrap `/query` answer (rank -> {"engine_id": ...})."""
    payload = orjson.dumps(answer)

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(body=payload, content_type="application/json")

    return handler


def ok_prefill() -> Handler:
    """A prefill that succeeds at once with a small completion."""
    payload = orjson.dumps(
        {"id": "cmpl-1", "object": "chat.completion", "choices": [], "usage": {}}
    )

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(body=payload, content_type="application/json")

    return handler


def answer(status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> Handler:
    """A fixed answer: an error quoting the prompt, a redirect ..."""

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=body, headers=headers)

    return handler


def redirect(location: str, status: int) -> Handler:
    return answer(status, b"", {"Location": location})


def gated(handler: Handler, gate: asyncio.Event) -> Handler:
    """`handler`, once the test opens `gate` (bounded: a test that never opens it fails)."""

    async def wait_then(request: web.Request) -> web.StreamResponse:
        async with asyncio.timeout(30):
            await gate.wait()
        return await handler(request)

    return wait_then


def padding(chunk: int = CHUNK) -> Callable[[], Iterator[bytes]]:
    """Endless filler, one chunk at a time (never allocated as a whole)."""
    block = b"x" * chunk

    def chunks() -> Iterator[bytes]:
        while True:
            yield block

    return chunks


def huge_engine_map(total: int, chunk: int = CHUNK) -> Callable[[], Iterator[bytes]]:
    """A valid `/query` answer of `total` bytes (a rank padded with filler), streamed."""
    head, tail = b'{"0": {"engine_id": "e0", "pad": "', b'"}}'

    def chunks() -> Iterator[bytes]:
        yield head
        left = total - len(head) - len(tail)
        block = b"x" * chunk
        while left > 0:
            yield block[: min(chunk, left)]
            left -= chunk
        yield tail

    return chunks


def many_ranks(count: int, batch: int = 4096) -> Callable[[], Iterator[bytes]]:
    """`{"0": {"engine_id": "e0"}, "1": ...}` with `count` ranks, generated in batches."""

    def chunks() -> Iterator[bytes]:
        yield b"{"
        for start in range(0, count, batch):
            items = (
                b'"%d": {"engine_id": "e%d"}' % (rank, rank)
                for rank in range(start, min(start + batch, count))
            )
            yield (b"," if start else b"") + b",".join(items)
        yield b"}"

    return chunks
