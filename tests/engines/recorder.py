"""A recording reverse proxy for the contract test: it sits on one leg (pdproc -> prefill,
or Envoy -> decode), passes every request on unchanged and keeps what crossed it, so the
same scenario can be compared between the real engines and pdproc-sim.

`shape()` reduces a JSON value to the set of its field paths and value kinds, the thing the
contract compares (values differ between any two runs; names, nesting and nulls must not).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from pdproc_sim.devstack import free_port

SESSION = web.AppKey("session", aiohttp.ClientSession)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
    "host",
}


@dataclass
class Exchange:
    path: str
    request: Any
    status: int
    content_type: str
    response: bytes
    request_id: str = ""  # the request's x-request-id

    def response_json(self) -> Any:
        return json.loads(self.response)

    def events(self) -> list[Any]:
        """The JSON events of an SSE answer ([DONE] left out)."""
        out = []
        for line in self.response.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[len("data: ") :]))
        return out


@dataclass
class Recorder:
    upstream: str  # http://host:port
    port: int = 0
    exchanges: list[Exchange] = field(default_factory=list)

    def clear(self) -> None:
        self.exchanges.clear()


@contextlib.contextmanager
def recording_proxy(upstream: str) -> Iterator[Recorder]:
    """A proxy on a free loopback port in a thread of its own, stopped on exit."""
    recorder = Recorder(upstream, free_port())
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner_box: list[web.AppRunner] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        return await _relay(recorder, request)

    async def start() -> None:
        runner_box.append(await _serve(recorder.port, handle))

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name=f"recorder-{recorder.port}", daemon=True)
    thread.start()
    started.wait(30)
    try:
        yield recorder
    finally:
        if runner_box:
            asyncio.run_coroutine_threadsafe(runner_box[0].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


async def _sent(writing: Awaitable[object]) -> bool:
    """Whether this write reached the client (False once it hung up)."""
    try:
        await writing
    except ConnectionError:
        return False
    return True


async def _relay(recorder: Recorder, request: web.Request) -> web.StreamResponse:
    """Pass one request on unchanged, stream the answer back, and record both."""
    raw = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    session: aiohttp.ClientSession = request.app[SESSION]
    async with session.request(
        request.method,
        recorder.upstream + request.path_qs,
        data=raw,
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=600),
    ) as upstream:
        answer = web.StreamResponse(status=upstream.status)
        for name, value in upstream.headers.items():
            if name.lower() not in HOP_BY_HOP:
                answer.headers[name] = value
        body = bytearray()
        client_left = not await _sent(answer.prepare(request))
        async for chunk in upstream.content.iter_any():
            body += chunk
            # Once the client hung up (pdproc cancelled its prefill), the engine's answer is
            # still read to its end and recorded: the engine did that work and counted it.
            client_left = client_left or not await _sent(answer.write(chunk))
        if not client_left:
            await answer.write_eof()
    recorder.exchanges.append(
        Exchange(
            request.path,
            _parsed(raw),
            upstream.status,
            upstream.headers.get("content-type", ""),
            bytes(body),
            request.headers.get("x-request-id", ""),
        )
    )
    return answer


def _parsed(raw: bytes) -> Any:
    """A request body as JSON when it is JSON, else as text."""
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode("utf-8", "replace")


async def _serve(port: int, handle: Handler) -> web.AppRunner:
    """The proxy's HTTP server on 127.0.0.1:`port`, every path and method to `handle`."""
    app = web.Application()
    app[SESSION] = aiohttp.ClientSession()
    app.router.add_route("*", "/{tail:.*}", handle)

    async def close_session(app: web.Application) -> None:
        await app[SESSION].close()

    app.on_cleanup.append(close_session)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "list"
    return "object"


def shape(value: Any, prefix: str = "$", depth: int = 3) -> set[str]:
    """`{"$.a:str", "$.b:null", "$.c[]:number", ...}`: field paths with their value kinds,
    `depth` levels down (lists by their first element)."""
    out = {f"{prefix}:{kind(value)}"}
    if depth == 0:
        return out
    if isinstance(value, dict):
        for key, item in value.items():
            out |= shape(item, f"{prefix}.{key}", depth - 1)
    elif isinstance(value, list) and value:
        out |= shape(value[0], f"{prefix}[]", depth - 1)
    return out
