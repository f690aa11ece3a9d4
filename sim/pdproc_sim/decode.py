"""Simulated decode instance (vLLM kv_consumer for Mooncake / NIXL, SGLang decode): it only
emits a token once the KV of the matching prefill has really arrived."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from pdproc_sim import engine_metrics, httpd
from pdproc_sim.connectors import (
    DEFAULT_KV_TIMEOUT_S,
    MOONCAKE,
    NIXLV2,
    SGLANG,
    SGLANG_NO_ROOM,
    DecodeTicket,
    check_connector,
    decode_ticket,
)
from pdproc_sim.openai_shapes import (
    DEFAULT_MODEL,
    MAX_GENERATED_TOKENS,
    Api,
    BadRequest,
    Completion,
    check_sampling,
    error_body,
    prompt_digest,
    wants_stream,
)
from pdproc_sim.prefix_cache import EngineCaches, block_hashes, rendered_prompt
from pdproc_sim.state import JsonObject, RoleState, TransferResult, fault_status

# The long poll itself ends at the KV timeout on the bootstrap side; this margin only guards
# against a bootstrap that never answers at all.
_KV_HTTP_MARGIN_S = 30.0
_KV_CONNECT_TIMEOUT_S = 5.0
_KNOWN_ENGINES_CAP = 100_000
_KV_ROUTE = {MOONCAKE: "/sim/kv/", NIXLV2: "/sim/nixl/", SGLANG: "/sim/sglang/"}


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    host: str = "127.0.0.1"
    port: int = 0
    first_token_delay_ms: float = 0.0
    itl_ms: float = 0.0
    # How long a decode waits for its KV; None: the connector's default (vLLM 480 s,
    # SGLang 300 s).
    kv_timeout_s: float | None = None
    default_tokens: int = 16
    model: str = DEFAULT_MODEL
    record_limit: int = 10_000
    record_max_body_bytes: int = 64 * 1024
    kv_connector: str = MOONCAKE
    # Reject completions that carry no KV hand-over (400) instead of serving them alone.
    # An SGLang decode always does.
    require_kv: bool = False
    # The decode's own prefix cache, in 16-token blocks (0: none): it keeps the blocks it
    # received and those it generated, so a request that lands here again finds them.
    prefix_cache_blocks: int = 0
    # Compute time per prompt token a decode serving a request alone finds uncached.
    prefill_ms_per_token: float = 0.0

    def __post_init__(self) -> None:
        check_connector(self.kv_connector)

    @property
    def kv_wait_s(self) -> float:
        if self.kv_timeout_s is not None:
            return self.kv_timeout_s
        return DEFAULT_KV_TIMEOUT_S[self.kv_connector]


@dataclass(frozen=True, slots=True)
class KvFailure:
    """Why a decode got no usable KV: a short `reason` (stats, records) and the detail."""

    reason: str
    detail: str

    def message(self, ticket: DecodeTicket) -> str:
        if ticket.connector != SGLANG:
            return f"KV transfer failed: {self.reason}: {self.detail}"
        room = ticket.room
        return (
            f"Decode transfer failed for request rank=0 bootstrap_room={room} "
            f"with exception KVTransferError(bootstrap_room={room}): {self.detail}"
        )

    def body(self, ticket: DecodeTicket, *, streamed: bool) -> JsonObject:
        # SGLang answers errors in its own shape, except in a stream (vLLM's shape there).
        sglang = ticket.connector == SGLANG and not streamed
        return error_body(500, self.message(ticket), "InternalServerError", sglang=sglang)


class DecodeState(RoleState):
    role = "decode"

    def __init__(self, config: DecodeConfig) -> None:
        super().__init__(config.record_limit, config.record_max_body_bytes)
        self.config = config
        self.connector = config.kv_connector
        self.sglang_errors = self.connector == SGLANG
        self.fault_status: int | None = None
        self.session: aiohttp.ClientSession | None = None
        # Mooncake: the prefill engines this decode has looked up in a bootstrap server's
        # /query (vLLM's `_remote_agents`): kept for the process's life, even once a restart
        # replaced them.
        self.known_engines: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.cache = EngineCaches(1, config.prefix_cache_blocks)
        self._zero_counters()

    def _zero_counters(self) -> None:
        self.completed = 0
        self.pd_requests = 0
        self.kv_ok = 0
        self.kv_failures: collections.Counter[str] = collections.Counter()

    def stats_json(self) -> JsonObject:
        stats = super().stats_json()
        stats.update(
            kv_connector=self.connector,
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
        self.cache.reset_counts()

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

    async def pull_kv(
        self, ticket: DecodeTicket, digest: str, record: JsonObject
    ) -> KvFailure | None:
        """Stand-in for the connector's transfer: ask the prefill's bootstrap / side-channel
        server for the transfer the ticket names (Mooncake and SGLang wait for it there), then
        check it is the KV this request needs."""
        started = time.monotonic()
        outcome = await self._poll(ticket)
        if isinstance(outcome, TransferResult):
            failure = _judge(ticket, digest, outcome)
            record["kv"] = {"reason": failure.reason if failure else None, **outcome.to_json()}
        else:
            failure = outcome
            if failure.reason == "timeout" and ticket.connector == SGLANG:
                failure = KvFailure(
                    "timeout",
                    f"Request {ticket.room} timed out after {time.monotonic() - started:.1f}s "
                    "in KVPoll.WaitingForInput",
                )
            record["kv"] = {"reason": failure.reason, "engine_id": None, "dp_rank": None}
        if failure is None:
            self.kv_ok += 1
        else:
            self.kv_failures[failure.reason] += 1
        return failure

    async def _poll(self, ticket: DecodeTicket) -> TransferResult | KvFailure:
        assert self.session is not None, "decode app not started"
        if ticket.connector == MOONCAKE and ticket.engine_id is not None:
            unknown = await self._look_up_engine(ticket, ticket.engine_id)
            if unknown is not None:
                return unknown
        timeout_s = self.config.kv_wait_s
        url = _kv_url(ticket, timeout_s)
        if url is None:
            return KvFailure("bootstrap_unreachable", f"bad address {ticket.url!r}")
        timeout = aiohttp.ClientTimeout(
            total=timeout_s + _KV_HTTP_MARGIN_S, sock_connect=_KV_CONNECT_TIMEOUT_S
        )
        try:
            async with self.session.get(url, timeout=timeout) as response:
                status, payload = response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            detail = f"{ticket.url}: {type(exc).__name__}: {exc}"
            return KvFailure("bootstrap_unreachable", detail)
        return _parse_poll(ticket, status, payload)

    async def _look_up_engine(self, ticket: DecodeTicket, engine_id: str) -> KvFailure | None:
        """vLLM's decode asks the bootstrap server's /query about an engine it does not
        know yet; one that is not there fails the request at once (kv_load_failure_policy
        "fail"). A known one is not asked about again, even after its pod restarted."""
        if engine_id in self.known_engines:
            return None
        assert self.session is not None
        url = ticket.url + "/query"
        timeout = aiohttp.ClientTimeout(total=_KV_CONNECT_TIMEOUT_S)
        try:
            async with self.session.get(url, timeout=timeout) as response:
                answer: Any = orjson.loads(await response.read()) if response.ok else {}
        except (aiohttp.ClientError, TimeoutError, ValueError, orjson.JSONDecodeError) as exc:
            detail = f"{ticket.url}: {type(exc).__name__}: {exc}"
            return KvFailure("bootstrap_unreachable", detail)
        ranks = answer.values() if isinstance(answer, dict) else ()
        for rank in ranks:
            if isinstance(rank, dict) and isinstance(rank.get("engine_id"), str):
                self.known_engines[rank["engine_id"]] = None
        while len(self.known_engines) > _KNOWN_ENGINES_CAP:
            self.known_engines.popitem(last=False)
        if engine_id in self.known_engines:
            return None
        detail = f"remote engine_id {engine_id} not found from bootstrap server {ticket.url}"
        return KvFailure("unknown_engine", detail)


def _kv_url(ticket: DecodeTicket, timeout_s: float) -> URL | None:
    path = _KV_ROUTE[ticket.connector] + quote(ticket.key, safe="")
    try:
        url = URL(ticket.url + path, encoded=True)
    except ValueError:
        return None
    if url.scheme not in ("http", "https") or not url.host:
        return None
    query = {"timeout_s": str(timeout_s)}
    if ticket.engine_id is not None:
        query["engine_id"] = ticket.engine_id
    return url.with_query(query)


def _parse_poll(ticket: DecodeTicket, status: int, payload: bytes) -> TransferResult | KvFailure:
    try:
        data: Any = orjson.loads(payload)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        return KvFailure("bootstrap_error", f"status {status} with a non-JSON body")
    if status == 404:
        reason = str(data.get("reason") or "bootstrap_error")
        return KvFailure(reason, _MISS_DETAILS.get(reason, reason).format(t=ticket))
    if status != 200:
        return KvFailure("bootstrap_error", f"status {status}")
    try:
        return TransferResult.from_json(data)
    except (KeyError, TypeError, ValueError):
        return KvFailure("bootstrap_error", "malformed transfer record")


_MISS_DETAILS = {
    "timeout": "no prefill for transfer {t.key} arrived in time",
    "unknown_engine": "engine {t.engine_id} is not served by {t.url}",
    "unknown_request": "{t.url} holds no KV for request {t.key} (never prefilled, already "
    "read, or expired)",
    "prefill_restarted": "the prefill engine restarted while transfer {t.key} waited",
    "shutdown": "the prefill server shut down",
}


def _judge(ticket: DecodeTicket, digest: str, result: TransferResult) -> KvFailure | None:
    """Is the transfer the KV this decode needs?"""
    key = ticket.key
    if result.failure is not None:
        return KvFailure("prefill_failed", result.failure)
    if ticket.engine_id is not None and result.engine_id != ticket.engine_id:
        return KvFailure(
            "engine_mismatch",
            f"transfer {key} was prefilled by engine {result.engine_id} "
            f"(dp rank {result.dp_rank}) but the decode was told {ticket.engine_id}",
        )
    if ticket.connector == NIXLV2:
        if result.block_ids != ticket.block_ids:
            return KvFailure(
                "block_ids_mismatch",
                f"request {key} holds blocks {list(result.block_ids)}, "
                f"the decode was told {list(ticket.block_ids)}",
            )
        both = result.request_id is not None and ticket.request_id is not None
        if both and result.request_id != ticket.request_id:
            return KvFailure(
                "request_id_mismatch",
                f"the prefill of {key} carried x-request-id {result.request_id!r}, "
                f"the decode {ticket.request_id!r}",
            )
    if result.prompt_digest and result.prompt_digest != digest:
        return KvFailure(
            "prompt_mismatch", f"transfer {key} holds the KV of another prompt than this one"
        )
    if not result.shipped:
        return KvFailure(
            "not_shipped",
            f"the prefill of transfer {key} did not finish length-capped at 1 token, so its "
            "KV was freed",
        )
    return None


@dataclass(frozen=True, slots=True)
class _Job:
    completion: Completion
    kv: DecodeTicket | None
    stream: bool
    digest: str
    prompt_text: str


async def _prompt_ready(state: DecodeState, job: _Job) -> _Job:
    """The prompt's KV is here (received, or found cached and the rest computed): the
    answer reports the cached tokens, and the cache keeps the prompt and what is generated."""
    caches = state.cache
    if not caches.enabled:
        return job
    completion = job.completion
    found = caches.lookup(0, job.prompt_text)
    received = job.kv is not None
    if not received:
        await httpd.pause(state.config.prefill_ms_per_token * found.uncached_tokens / 1000)
    caches.count(0, found, received=received)
    caches.store(0, block_hashes(job.prompt_text + completion.text))
    # vLLM counts KV received from the prefill as computed before the decode ran.
    cached = found.prompt_tokens - 1 if received else found.cached_tokens
    counted = dataclasses.replace(
        completion, prompt_tokens=found.prompt_tokens, cached_tokens=cached
    )
    return dataclasses.replace(job, completion=counted)


async def _serve_completion(
    state: DecodeState,
    api: Api,
    request: web.Request,
    exchange: httpd.Exchange,
    body: JsonObject,
    body_bytes: int,
) -> web.StreamResponse:
    job = _validate(state, api, request, body, body_bytes)
    if job.kv is not None:
        state.pd_requests += 1
    if job.stream:
        return await _stream(state, job, request, exchange)
    return await _unary(state, job, exchange)


def _validate(
    state: DecodeState, api: Api, request: web.Request, body: JsonObject, body_bytes: int
) -> _Job:
    limit = check_sampling(api, body)
    kv = decode_ticket(state.connector, body, httpd.lower_headers(request))
    if kv is None and state.connector == SGLANG:
        raise BadRequest(SGLANG_NO_ROOM)
    if kv is None and state.config.require_kv:
        raise BadRequest("this decode serves only P/D requests: kv_transfer_params missing")
    stream = wants_stream(body)
    if stream and api is Api.GENERATE:
        raise BadRequest("the simulator does not stream /inference/v1/generate")
    n_tokens = min(limit or state.config.default_tokens, MAX_GENERATED_TOKENS)
    completion = Completion.for_request(api, body, body_bytes, n_tokens, limit, state.config.model)
    return _Job(completion, kv, stream, prompt_digest(api, body), rendered_prompt(api, body))


def _timing(state: DecodeState) -> tuple[float, float]:
    return state.config.first_token_delay_ms / 1000, state.config.itl_ms / 1000


async def _unary(state: DecodeState, job: _Job, exchange: httpd.Exchange) -> web.StreamResponse:
    assert exchange.record is not None
    if job.kv is not None:
        failure = await state.pull_kv(job.kv, job.digest, exchange.record)
        if failure is not None:
            reply = httpd.json_response(failure.body(job.kv, streamed=False), 500)
            return exchange.reply(reply, f"kv_failed:{failure.reason}")
    job = await _prompt_ready(state, job)
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
        failure = await state.pull_kv(job.kv, job.digest, exchange.record)
        if failure is not None:
            exchange.outcome = f"kv_failed:{failure.reason}"
            return await _stream_error(exchange, response, failure.body(job.kv, streamed=True))
    job = await _prompt_ready(state, job)
    await httpd.stream_completion(exchange, response, job.completion, _timing(state))
    if not exchange.was_cancelled:
        state.completed += 1
    return response


async def _stream_error(
    exchange: httpd.Exchange, response: web.StreamResponse, error: JsonObject
) -> web.StreamResponse:
    # Headers are out already, so the server can only report the error in-band and end the
    # stream.
    try:
        await response.write(b"data: " + orjson.dumps(error) + b"\n\n")
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
    httpd.add_metrics_route(app, partial(engine_metrics.render, state.cache, state.config.model))
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
