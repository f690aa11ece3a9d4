"""Simulated vLLM decode instance (Mooncake kv_consumer)."""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from pdproc_sim import httpd
from pdproc_sim.openai_shapes import (
    DEFAULT_MODEL,
    MAX_GENERATED_TOKENS,
    Api,
    BadRequest,
    Completion,
    check_sampling,
    error_body,
    role_kv_params,
    wants_stream,
)
from pdproc_sim.state import JsonObject, RoleState, TransferResult, fault_status

# The long poll itself ends at kv_timeout_s on the bootstrap side; this margin only guards
# against a bootstrap that never answers at all.
_KV_HTTP_MARGIN_S = 30.0
_KV_CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    host: str = "127.0.0.1"
    port: int = 0
    first_token_delay_ms: float = 0.0
    itl_ms: float = 0.0
    kv_timeout_s: float = 480.0
    default_tokens: int = 16
    model: str = DEFAULT_MODEL
    record_limit: int = 10_000
    record_max_body_bytes: int = 64 * 1024


@dataclass(frozen=True, slots=True)
class KvParams:
    transfer_id: str
    bootstrap_addr: str
    engine_id: str


@dataclass(frozen=True, slots=True)
class KvFailure:
    reason: str
    detail: str

    @property
    def message(self) -> str:
        return f"KV transfer failed: {self.reason}: {self.detail}"

    def body(self) -> JsonObject:
        return error_body(500, self.message, "InternalServerError")


def decode_kv_params(body: JsonObject) -> KvParams | None:
    """Check kv_transfer_params like the llm-d mock decode (vLLM itself would fall back)."""
    params = role_kv_params(body, "decode", remote_decode=False)
    if params is None:
        return None
    values = []
    for name in ("transfer_id", "remote_bootstrap_addr", "remote_engine_id"):
        value = params.get(name)
        if not isinstance(value, str) or not value:
            raise BadRequest(f"kv_transfer_params.{name} must be a non-empty string")
        values.append(value)
    return KvParams(*values)


class DecodeState(RoleState):
    role = "decode"

    def __init__(self, config: DecodeConfig) -> None:
        super().__init__(config.record_limit, config.record_max_body_bytes)
        self.config = config
        self.fault_status: int | None = None
        self.session: aiohttp.ClientSession | None = None
        self._zero_counters()

    def _zero_counters(self) -> None:
        self.completed = 0
        self.pd_requests = 0
        self.kv_ok = 0
        self.kv_failures: collections.Counter[str] = collections.Counter()

    def stats_json(self) -> JsonObject:
        stats = super().stats_json()
        stats.update(
            completed=self.completed,
            pd_requests=self.pd_requests,
            kv_ok=self.kv_ok,
            kv_failures=dict(self.kv_failures),
            faults=self.faults_json(),
        )
        return stats

    def reset(self) -> None:
        super().reset()
        self._zero_counters()

    def injected_status(self) -> int | None:
        return self.fault_status

    def faults_json(self) -> JsonObject:
        return {"status": self.fault_status}

    def apply_faults(self, patch: JsonObject) -> None:
        patch = dict(patch)
        clear = patch.pop("clear", False)
        if not isinstance(clear, bool):
            raise ValueError(f"clear must be a boolean, got {clear!r}")
        status = None if clear else self.fault_status
        if "status" in patch:
            status = fault_status("status", patch.pop("status"))
        if patch:
            raise ValueError(f"unknown fault fields: {sorted(patch)}")
        self.fault_status = status

    async def pull_kv(self, params: KvParams, record: JsonObject) -> KvFailure | None:
        """Stand-in for the Mooncake pull: long-poll the prefill's bootstrap for the transfer."""
        outcome = await self._poll(params)
        if isinstance(outcome, TransferResult):
            failure = _judge(params, outcome)
            record["kv"] = {"reason": failure.reason if failure else None, **outcome.to_json()}
        else:
            failure = outcome
            record["kv"] = {"reason": failure.reason, "engine_id": None, "dp_rank": None}
        if failure is None:
            self.kv_ok += 1
        else:
            self.kv_failures[failure.reason] += 1
        return failure

    async def _poll(self, params: KvParams) -> TransferResult | KvFailure:
        assert self.session is not None, "decode app not started"
        timeout_s = self.config.kv_timeout_s
        url = _kv_url(params, timeout_s)
        if url is None:
            return KvFailure("bootstrap_unreachable", f"bad address {params.bootstrap_addr!r}")
        timeout = aiohttp.ClientTimeout(
            total=timeout_s + _KV_HTTP_MARGIN_S, sock_connect=_KV_CONNECT_TIMEOUT_S
        )
        try:
            async with self.session.get(url, timeout=timeout) as response:
                status, payload = response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            detail = f"{params.bootstrap_addr}: {type(exc).__name__}: {exc}"
            return KvFailure("bootstrap_unreachable", detail)
        return _parse_poll(params, status, payload)


def _kv_url(params: KvParams, timeout_s: float) -> URL | None:
    base = params.bootstrap_addr.rstrip("/")
    try:
        url = URL(f"{base}/sim/kv/{quote(params.transfer_id, safe='')}", encoded=True)
    except ValueError:
        return None
    if url.scheme not in ("http", "https") or not url.host:
        return None
    return url.with_query(engine_id=params.engine_id, timeout_s=str(timeout_s))


def _parse_poll(params: KvParams, status: int, payload: bytes) -> TransferResult | KvFailure:
    try:
        data: Any = orjson.loads(payload)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        return KvFailure("bootstrap_error", f"status {status} with a non-JSON body")
    if status == 404:
        reason = str(data.get("reason") or "bootstrap_error")
        return KvFailure(reason, _MISS_DETAILS.get(reason, reason).format(p=params))
    if status != 200:
        return KvFailure("bootstrap_error", f"status {status}")
    try:
        return TransferResult(str(data["engine_id"]), int(data["dp_rank"]), bool(data["shipped"]))
    except (KeyError, TypeError, ValueError):
        return KvFailure("bootstrap_error", "malformed transfer record")


_MISS_DETAILS = {
    "timeout": "no prefill for transfer {p.transfer_id} arrived in time",
    "unknown_engine": "engine {p.engine_id} is not served by {p.bootstrap_addr}",
    "prefill_restarted": "the prefill engine restarted while transfer {p.transfer_id} waited",
    "shutdown": "the prefill server shut down",
}


def _judge(params: KvParams, result: TransferResult) -> KvFailure | None:
    if result.engine_id != params.engine_id:
        return KvFailure(
            "engine_mismatch",
            f"transfer {params.transfer_id} was prefilled by engine {result.engine_id} "
            f"(dp rank {result.dp_rank}) but the decode was told {params.engine_id}",
        )
    if not result.shipped:
        return KvFailure(
            "not_shipped",
            f"the prefill of transfer {params.transfer_id} did not finish length-capped "
            "at 1 token, so its KV was freed",
        )
    return None


@dataclass(frozen=True, slots=True)
class _Job:
    completion: Completion
    kv: KvParams | None
    stream: bool


async def _serve_completion(
    state: DecodeState,
    api: Api,
    request: web.Request,
    exchange: httpd.Exchange,
    body: JsonObject,
    body_bytes: int,
) -> web.StreamResponse:
    job = _validate(state, api, body, body_bytes)
    if job.kv is not None:
        state.pd_requests += 1
    if job.stream:
        return await _stream(state, job, request, exchange)
    return await _unary(state, job, exchange)


def _validate(state: DecodeState, api: Api, body: JsonObject, body_bytes: int) -> _Job:
    limit = check_sampling(api, body)
    kv = decode_kv_params(body)
    stream = wants_stream(body)
    if stream and api is Api.GENERATE:
        raise BadRequest("the simulator does not stream /inference/v1/generate")
    n_tokens = min(limit or state.config.default_tokens, MAX_GENERATED_TOKENS)
    completion = Completion.for_request(api, body, body_bytes, n_tokens, limit, state.config.model)
    return _Job(completion, kv, stream)


def _timing(state: DecodeState) -> tuple[float, float]:
    return state.config.first_token_delay_ms / 1000, state.config.itl_ms / 1000


async def _unary(state: DecodeState, job: _Job, exchange: httpd.Exchange) -> web.StreamResponse:
    assert exchange.record is not None
    if job.kv is not None:
        failure = await state.pull_kv(job.kv, exchange.record)
        if failure is not None:
            reply = httpd.json_response(failure.body(), 500)
            return exchange.reply(reply, f"kv_failed:{failure.reason}")
    first_token_s, itl_s = _timing(state)
    await httpd.pause(first_token_s + itl_s * max(0, job.completion.n_tokens - 1))
    state.completed += 1
    return exchange.reply(httpd.json_response(job.completion.body()), "ok")


async def _stream(
    state: DecodeState, job: _Job, request: web.Request, exchange: httpd.Exchange
) -> web.StreamResponse:
    assert exchange.record is not None
    response = await httpd.open_sse(request, exchange)
    if job.kv is not None:
        failure = await state.pull_kv(job.kv, exchange.record)
        if failure is not None:
            exchange.outcome = f"kv_failed:{failure.reason}"
            return await _stream_error(exchange, response, failure)
    await httpd.stream_completion(exchange, response, job.completion, _timing(state))
    if not exchange.was_cancelled:
        state.completed += 1
    return response


async def _stream_error(
    exchange: httpd.Exchange, response: web.StreamResponse, failure: KvFailure
) -> web.StreamResponse:
    # Headers are out already, so vLLM can only report the error in-band and end the stream.
    try:
        await response.write(b"data: " + orjson.dumps(failure.body()) + b"\n\n")
        await response.write_eof()
    except ConnectionResetError:
        exchange.cancel()
    return response


async def _passthrough(
    state: DecodeState, request: web.Request, exchange: httpd.Exchange
) -> web.StreamResponse:
    raw = await request.read()
    body: Any = None
    if raw:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = raw.decode("utf-8", "replace")
    exchange.record = httpd.record_request(state, request, raw, body)
    reply = httpd.json_response({"path": request.path, "method": request.method})
    return exchange.reply(reply, "passthrough")


def build_decode_app(state: DecodeState) -> web.Application:
    app = httpd.new_app()
    httpd.add_completion_routes(app, state, partial(_serve_completion, state))
    httpd.add_model_routes(app, state.config.model)
    httpd.add_introspection_routes(app, state)
    # Registered last: aiohttp falls through to it for unknown paths and for other methods
    # on the routes above, so passthrough tests see every request arrive.
    passthrough = httpd.exchange_handler(state, partial(_passthrough, state))
    app.router.add_route("*", "/{tail:.*}", passthrough)
    app.cleanup_ctx.append(_session_context(state))
    return app


def _session_context(state: DecodeState) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(_: web.Application) -> AsyncIterator[None]:
        # One pooled session; limit=0 because every waiting decode holds a long-poll connection.
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        state.session = session
        try:
            yield
        finally:
            state.session = None
            await session.close()

    return context
