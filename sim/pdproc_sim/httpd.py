"""aiohttp plumbing shared by the simulated servers: sockets, JSON, SSE, /sim/* routes."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from pdproc_sim.openai_shapes import Api, BadRequest, Completion, error_body, parse_object
from pdproc_sim.state import JsonObject, RoleState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ExchangeServer = Callable[[web.Request, "Exchange"], Awaitable[web.StreamResponse]]
BodyServer = Callable[[web.Request, "Exchange", JsonObject, int], Awaitable[web.StreamResponse]]
ApiServer = Callable[[Api, web.Request, "Exchange", JsonObject, int], Awaitable[web.StreamResponse]]

# Prompts in benchmarks are ~1 MiB of JSON; aiohttp's default cap (1 MiB) would reject them.
CLIENT_MAX_SIZE = 256 * 1024 * 1024
# Graceful drain on close; long polls and hung handlers are woken or cancelled after this.
SHUTDOWN_TIMEOUT_S = 1.0
_BACKLOG = 1024

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(
    status: int, message: str, err_type: str | None = None, *, sglang: bool = False
) -> web.Response:
    return json_response(error_body(status, message, err_type, sglang=sglang), status)


def bracket_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def format_hostport(host: str, port: int) -> str:
    return f"{bracket_host(host)}:{port}"


def lower_headers(request: web.Request) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in request.headers.items():
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return headers


def record_request(state: RoleState, request: web.Request, raw: bytes, body: Any) -> JsonObject:
    return state.log.add(
        method=request.method,
        path=request.path,
        query=request.query_string,
        headers=lower_headers(request),
        raw_body=raw,
        body=body,
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind ourselves so port 0 can be read back before anything is announced."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    # handler_cancellation: a client disconnect must cancel the handler, as vLLM aborts
    # the request; the decode's "cancelled" counter depends on it.
    runner = web.AppRunner(
        app, access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S
    )
    await runner.setup()
    try:
        sock = bind_socket(host, port)
        bound_port: int = sock.getsockname()[1]
        await web.SockSite(runner, sock, backlog=_BACKLOG).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, bound_port


def new_app() -> web.Application:
    return web.Application(client_max_size=CLIENT_MAX_SIZE)


async def pause(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


async def open_sse(request: web.Request, exchange: Exchange) -> web.StreamResponse:
    """Send the 200 SSE headers now, before any waiting, as vLLM does for stream=true."""
    response = web.StreamResponse(status=200, headers=_SSE_HEADERS)
    exchange.status = 200
    await response.prepare(request)
    return response


async def write_tokens(
    response: web.StreamResponse, completion: Completion, first_token_s: float, itl_s: float
) -> None:
    await pause(first_token_s)
    for frame in completion.head_frames():
        await response.write(frame)
    for index in range(completion.n_tokens):
        if index:
            await pause(itl_s)
        await response.write(completion.token_frame(index))
    for frame in completion.tail_frames():
        await response.write(frame)
    await response.write_eof()


def add_introspection_routes(app: web.Application, state: RoleState) -> None:
    async def stats(_: web.Request) -> web.StreamResponse:
        return json_response(state.stats_json())

    async def requests(request: web.Request) -> web.StreamResponse:
        limit_raw = request.query.get("limit")
        try:
            limit = int(limit_raw) if limit_raw is not None else None
        except ValueError:
            return error_response(400, f"limit must be an integer, got {limit_raw!r}")
        records = state.log.last(limit, request.query.get("path"))
        return json_response({"requests": records, "total_received": state.log.total})

    async def reset(_: web.Request) -> web.StreamResponse:
        state.reset()
        return json_response({"ok": True})

    async def get_faults(_: web.Request) -> web.StreamResponse:
        return json_response(state.faults_json())

    async def set_faults(request: web.Request) -> web.StreamResponse:
        try:
            patch = orjson.loads(await request.read() or b"{}")
            if not isinstance(patch, dict):
                raise ValueError("faults must be a JSON object")
            state.apply_faults(patch)
        except (ValueError, orjson.JSONDecodeError) as exc:
            return error_response(400, str(exc))
        return json_response(state.faults_json())

    app.router.add_get("/sim/stats", stats)
    app.router.add_get("/sim/requests", requests)
    app.router.add_post("/sim/reset", reset)
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_post("/sim/faults", set_faults)


def add_metrics_route(app: web.Application, page: Callable[[], str]) -> None:
    """GET /metrics: the engine's Prometheus page (vLLM's metric names)."""

    async def metrics(_: web.Request) -> web.StreamResponse:
        return web.Response(text=page(), content_type="text/plain", charset="utf-8")

    app.router.add_get("/metrics", metrics)


def add_model_routes(app: web.Application, model: str) -> None:
    async def health(_: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def models(_: web.Request) -> web.StreamResponse:
        entry = {"id": model, "object": "model", "created": 0, "owned_by": "vllm", "root": model}
        return json_response({"object": "list", "data": [entry]})

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)


class Exchange:
    """Book-keeping for one request: in-flight gauge, status counter and its record."""

    __slots__ = ("_path", "_state", "outcome", "record", "status", "was_cancelled")

    def __init__(self, state: RoleState, request: web.Request) -> None:
        self._state = state
        self._path = request.path
        self.status: int | None = None
        self.record: JsonObject | None = None
        self.outcome: str | None = None
        self.was_cancelled = False
        state.in_flight += 1

    def reply(self, response: web.Response, outcome: str) -> web.Response:
        self.status = response.status
        self.outcome = outcome
        return response

    def cancel(self) -> None:
        if not self.was_cancelled:
            self.was_cancelled = True
            self.outcome = "cancelled"
            self._state.cancelled += 1

    def finish(self) -> None:
        state = self._state
        state.in_flight -= 1
        if self.was_cancelled:
            key = "cancelled"
        else:
            key = "error" if self.status is None else str(self.status)
        state.count_response(self._path, key)
        record = self.record
        if record is not None:
            record["status"] = self.status
            record["outcome"] = self.outcome
            record["served_at"] = time.time()


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def exchange_handler(state: RoleState, serve: ExchangeServer) -> Handler:
    """An aiohttp handler that keeps the books of each request (gauge, counter, record)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        exchange = Exchange(state, request)
        try:
            return await serve(request, exchange)
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client goes away; count it, then unwind.
            exchange.cancel()
            raise
        except Exception as exc:
            # A client gone while the answer's headers were written (Envoy resetting a
            # decode stream pdproc failed) is a cancelled request too, as vLLM aborts it.
            if isinstance(exc, ConnectionResetError) and _client_gone(request):
                exchange.cancel()
            else:
                exchange.outcome = "error"
            raise
        finally:
            exchange.finish()

    return handler


def json_handler(state: RoleState, serve: BodyServer) -> Handler:
    """The plumbing every simulated completion endpoint shares: read the body, answer 400
    unless it is a JSON object, record it, answer an injected fault, then `serve` it. A
    BadRequest that `serve` raises (before it starts answering) becomes a 400."""

    sglang = state.sglang_errors

    async def serve_json(request: web.Request, exchange: Exchange) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = parse_object(raw)
        except BadRequest as exc:
            exchange.record = record_request(state, request, raw, None)
            return exchange.reply(error_response(400, str(exc), sglang=sglang), "rejected")
        exchange.record = record_request(state, request, raw, body)
        injected = state.injected_status()
        if injected is not None:
            reply = error_response(injected, f"simulated {state.role} failure", sglang=sglang)
            return exchange.reply(reply, "fault")
        try:
            return await serve(request, exchange, body, len(raw))
        except BadRequest as exc:
            return exchange.reply(error_response(400, str(exc), sglang=sglang), "rejected")

    return exchange_handler(state, serve_json)


async def stream_completion(
    exchange: Exchange,
    response: web.StreamResponse,
    completion: Completion,
    timing: tuple[float, float],
) -> web.StreamResponse:
    """Write the token frames; a vanished client ends the stream quietly, counted as cancelled."""
    try:
        await write_tokens(response, completion, *timing)
    except ConnectionResetError:
        exchange.cancel()
        return response
    exchange.outcome = exchange.outcome or "ok"
    return response


def add_completion_routes(app: web.Application, state: RoleState, serve: ApiServer) -> None:
    """POST routes for every simulated API, each through `json_handler`."""
    for api in Api:
        app.router.add_post(api.value, json_handler(state, partial(serve, api)))
