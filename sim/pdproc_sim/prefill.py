"""Simulated prefill instance (vLLM kv_producer for Mooncake / NIXL, SGLang prefill) and its
bootstrap / side-channel server, where decodes meet the KV they need."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web

from pdproc_sim import engine_metrics, httpd
from pdproc_sim.connectors import (
    MOONCAKE,
    NIXLV2,
    SGLANG,
    SGLANG_BOOTSTRAP_TIMEOUT_S,
    PrefillTicket,
    check_connector,
    prefill_ticket,
)
from pdproc_sim.openai_shapes import (
    DEFAULT_MODEL,
    MAX_GENERATED_TOKENS,
    Api,
    BadRequest,
    Completion,
    check_sampling,
    check_single_sequence,
    prompt_digest,
    prompt_tokens,
    wants_stream,
)
from pdproc_sim.prefix_cache import EngineCaches, Lookup, rendered_prompt
from pdproc_sim.state import (
    JsonObject,
    RoleState,
    TransferRegistry,
    TransferResult,
    fault_status,
)

DP_RANK_HEADER = "X-data-parallel-rank"
BOOTSTRAP_MODES = ("ok", "down", "slow", "garbage", "empty")
# "slow" without an explicit delay must outlast the gateway's 5 s bootstrap timeout.
DEFAULT_SLOW_BOOTSTRAP_S = 6.0
KV_PARAMS_MODES = ("ok", "missing")
# worker_addr ports are never dialled (the sim pulls KV over HTTP); they only fill the shape.
_FAKE_ZMQ_PORT_BASE = 50000
# vLLM's default KV block size: a nixlv2 prefill names ceil(prompt tokens / 16) blocks.
_BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_port: int = 0
    dp_ranks: int = 1
    engine_id_prefix: str | None = None
    prefill_delay_ms: float = 0.0
    prefill_ms_per_kib: float = 0.0
    kv_ttl_s: float = 600.0
    default_tokens: int = 16
    model: str = DEFAULT_MODEL
    record_limit: int = 10_000
    record_max_body_bytes: int = 64 * 1024
    registry_cap: int = 100_000
    kv_connector: str = MOONCAKE
    # SGLang: how long a prefill waits for its decode to bootstrap (then 500).
    sglang_bootstrap_timeout_s: float = SGLANG_BOOTSTRAP_TIMEOUT_S
    # The prefix cache per DP rank, in 16-token blocks (0: none, every prompt computed).
    prefix_cache_blocks: int = 0
    # Compute time per prompt token not found in the cache.
    prefill_ms_per_token: float = 0.0
    # Prefills a DP rank computes at once; the rest wait in FIFO order (0: no limit).
    rank_concurrency: int = 0

    def __post_init__(self) -> None:
        check_connector(self.kv_connector)


@dataclass(slots=True)
class PrefillFaults:
    prefill_status: int | None = None
    prefill_hang: bool = False
    prefill_fail_rate: float = 0.0
    bootstrap: str = "ok"
    bootstrap_delay_s: float | None = None
    # The prefill answers 200 but its KV never reaches any decode (lost transfer).
    kv_drop: bool = False
    # nixlv2: "missing" answers kv_transfer_params null, as a prefill that kept no KV would.
    kv_params: str = "ok"

    def bootstrap_delay(self) -> float:
        if self.bootstrap_delay_s is not None:
            return self.bootstrap_delay_s
        return DEFAULT_SLOW_BOOTSTRAP_S if self.bootstrap == "slow" else 0.0


def _number(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {value!r}")
    return value


def _fail_rate(name: str, value: Any) -> float:
    return _number(name, value, 0, 1)


def _bootstrap_mode(name: str, value: Any) -> str:
    if value not in BOOTSTRAP_MODES:
        raise ValueError(f"{name} must be one of {list(BOOTSTRAP_MODES)}, got {value!r}")
    result: str = value
    return result


def _kv_params_mode(name: str, value: Any) -> str:
    if value not in KV_PARAMS_MODES:
        raise ValueError(f"{name} must be one of {list(KV_PARAMS_MODES)}, got {value!r}")
    result: str = value
    return result


def _optional_delay(name: str, value: Any) -> float | None:
    return None if value is None else _number(name, value, 0, 3600)


_FAULT_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "prefill_status": fault_status,
    "prefill_hang": _boolean,
    "prefill_fail_rate": _fail_rate,
    "bootstrap": _bootstrap_mode,
    "bootstrap_delay_s": _optional_delay,
    "kv_drop": _boolean,
    "kv_params": _kv_params_mode,
}
FAULT_FIELDS = frozenset(_FAULT_FIELDS)


def _patched_faults(current: PrefillFaults, patch: JsonObject) -> PrefillFaults:
    """Apply a partial update; `"clear": true` starts from the defaults. All or nothing."""
    patch = dict(patch)
    clear = _boolean("clear", patch.pop("clear", False))
    unknown = sorted(set(patch) - set(_FAULT_FIELDS))
    if unknown:
        raise ValueError(f"unknown fault fields: {unknown}")
    changes = {name: _FAULT_FIELDS[name](name, value) for name, value in patch.items()}
    return dataclasses.replace(PrefillFaults() if clear else current, **changes)


def make_engine_ids(prefix: str | None, generation: int, ranks: int) -> list[str]:
    """vLLM's engine_id is a fresh uuid4 per start; with DP each engine adds `_dp<N>`."""
    if prefix is None:
        base = uuid.uuid4().hex
    else:
        base = prefix if generation == 0 else f"{prefix}-r{generation}"
    return [f"{base}_dp{rank}" for rank in range(ranks)]


class PrefillState(RoleState):
    role = "prefill"

    def __init__(self, config: PrefillConfig) -> None:
        super().__init__(config.record_limit, config.record_max_body_bytes)
        if config.dp_ranks < 1:
            raise ValueError("dp_ranks must be >= 1")
        self.config = config
        self.generation = 0
        self.engine_ids = make_engine_ids(config.engine_id_prefix, 0, config.dp_ranks)
        self.connector = config.kv_connector
        self.registry = TransferRegistry(config.kv_ttl_s, config.registry_cap)
        # SGLang: rooms whose decode has bootstrapped (a prefill waits for its decode).
        self.arrivals = TransferRegistry(config.kv_ttl_s, config.registry_cap)
        self.rooms_in_flight: set[str] = set()
        self.sglang_errors = self.connector == SGLANG
        self._next_block = 1
        self.faults = PrefillFaults()
        self.bootstrap_port = 0
        # Set means "not hanging"; hung prefills wait on it and go on when the fault is lifted.
        self.hang_gate = asyncio.Event()
        self.hang_gate.set()
        self._round_robin = itertools.count()
        self.cache = EngineCaches(config.dp_ranks, config.prefix_cache_blocks)
        # FIFO per rank: asyncio's semaphore wakes its waiters in order.
        self.rank_slots = [
            asyncio.Semaphore(config.rank_concurrency) if config.rank_concurrency else None
            for _ in range(config.dp_ranks)
        ]
        self._zero_counters()

    def _zero_counters(self) -> None:
        self.served_per_rank: collections.Counter[int] = collections.Counter()
        self.prefills_per_rank: collections.Counter[int] = collections.Counter()
        self.shipped = 0
        self.not_shipped = 0
        self.bootstrap_queries = 0
        self.kv_polls = 0
        self.kv_dropped = 0
        self.restarts = 0

    def choose_rank(self, header: str | None) -> int:
        ranks = self.config.dp_ranks
        if header is not None:
            try:
                rank = int(header)
            except ValueError:
                pass  # vLLM ignores a non-integer header and load-balances instead.
            else:
                if not 0 <= rank < ranks:
                    raise BadRequest(f"data_parallel_rank {rank} is out of range [0, {ranks}).")
                return rank
        return next(self._round_robin) % ranks

    def injected_status(self) -> int | None:
        faults = self.faults
        if faults.prefill_status is not None:
            return faults.prefill_status
        if faults.prefill_fail_rate and random.random() < faults.prefill_fail_rate:
            return 500
        return None

    def compute_delay_s(self, body_bytes: int, found: Lookup | None = None) -> float:
        """The prefill's compute time: only the share of the prompt not cached costs."""
        config = self.config
        share = 1.0
        per_token = 0.0
        if found is not None:
            share = found.uncached_tokens / max(1, found.prompt_tokens)
            per_token = config.prefill_ms_per_token * found.uncached_tokens
        per_kib = config.prefill_ms_per_kib * body_bytes / 1024 * share
        return (config.prefill_delay_ms + per_kib + per_token) / 1000

    def finish_transfer(self, key: str, result: TransferResult) -> None:
        """Publish a finished prefill to decodes (unless a kv_drop fault loses it)."""
        if self.faults.kv_drop:
            self.kv_dropped += 1
        else:
            self.registry.complete(key, result)
        self.prefills_per_rank[result.dp_rank] += 1
        if result.shipped:
            self.shipped += 1
        else:
            self.not_shipped += 1

    def allocate_blocks(self, prompt_tokens: int) -> tuple[int, ...]:
        """Block ids for a nixlv2 prefill's KV: ceil(tokens / 16) fresh numbers."""
        count = max(1, -(-prompt_tokens // _BLOCK_TOKENS))
        first, self._next_block = self._next_block, self._next_block + count
        if self._next_block > 1 << 30:
            self._next_block = 1
        return tuple(range(first, first + count))

    def side_channel_host(self) -> str:
        """remote_host a nixlv2 prefill names (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST): the listen
        address, or loopback when it listens on every address."""
        host = self.config.host
        return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)

    def restart(self) -> None:
        """A pod restart: new engine ids, and every KV block (done or awaited) is gone. A
        Mooncake decode waiting for one is not told: it waits for its abort timeout."""
        self.generation += 1
        self.restarts += 1
        self.engine_ids = make_engine_ids(
            self.config.engine_id_prefix, self.generation, self.config.dp_ranks
        )
        self.cache.clear()
        if self.connector == MOONCAKE:
            self.registry.orphan_all()
        else:
            self.registry.forget_all("prefill_restarted")
        self.arrivals.forget_all("prefill_restarted")

    def shutdown(self) -> None:
        self.registry.forget_all("shutdown")
        self.arrivals.forget_all("shutdown")
        self.hang_gate.set()

    def query_json(self) -> JsonObject:
        host = httpd.bracket_host(self.config.host)
        return {
            str(rank): {
                "engine_id": engine_id,
                "worker_addr": {"0": {"0": f"tcp://{host}:{_FAKE_ZMQ_PORT_BASE + rank}"}},
            }
            for rank, engine_id in enumerate(self.engine_ids)
        }

    def stats_json(self) -> JsonObject:
        stats = super().stats_json()
        stats.update(
            kv_connector=self.connector,
            served_per_rank={str(r): n for r, n in sorted(self.served_per_rank.items())},
            prefills_per_rank={str(r): n for r, n in sorted(self.prefills_per_rank.items())},
            transfers={
                "shipped": self.shipped,
                "not_shipped": self.not_shipped,
                "stored": self.registry.stored,
                "waiting": self.registry.waiting,
            },
            bootstrap_queries=self.bootstrap_queries,
            kv_polls=self.kv_polls,
            kv_dropped=self.kv_dropped,
            restarts=self.restarts,
            generation=self.generation,
            engine_ids={str(r): e for r, e in enumerate(self.engine_ids)},
            prompt_tokens_by_source={
                f"{rank}/{source}": n
                for (rank, source), n in sorted(self.cache.tokens_by_source.items())
            },
            faults=self.faults_json(),
        )
        return stats

    def reset(self) -> None:
        super().reset()
        self._zero_counters()
        self.cache.reset_counts()

    def faults_json(self) -> JsonObject:
        return dataclasses.asdict(self.faults)

    def apply_faults(self, patch: JsonObject) -> None:
        self.faults = _patched_faults(self.faults, patch)
        if self.faults.prefill_hang:
            self.hang_gate.clear()
        else:
            self.hang_gate.set()


@dataclass(slots=True)
class _Job:
    """A validated prefill request; `ticket` is None for a plain (non-P/D) one."""

    api: Api
    body: JsonObject
    body_bytes: int
    rank: int
    ticket: PrefillTicket | None
    limit: int | None
    digest: str
    # Prompt tokens found in the prefix cache (None: the pod has no prefix cache).
    cached_tokens: int | None = None
    # With a prefix cache: the prompt's tokens as the cache counted them (chat template
    # included).
    prompt_tokens: int | None = None


async def _serve_completion(
    state: PrefillState,
    api: Api,
    request: web.Request,
    exchange: httpd.Exchange,
    body: JsonObject,
    body_bytes: int,
) -> web.StreamResponse:
    assert exchange.record is not None
    job = _validate(state, api, request, body, body_bytes, exchange.record)
    room = job.ticket.key if job.ticket is not None and job.ticket.room is not None else None
    if room is None:
        return await _run_prefill(state, job, request, exchange)
    state.rooms_in_flight.add(room)
    try:
        return await _run_prefill(state, job, request, exchange)
    finally:
        state.rooms_in_flight.discard(room)


def _validate(
    state: PrefillState,
    api: Api,
    request: web.Request,
    body: JsonObject,
    body_bytes: int,
    record: JsonObject,
) -> _Job:
    rank = state.choose_rank(request.headers.get(DP_RANK_HEADER))
    record["rank"] = rank
    headers = httpd.lower_headers(request)
    ticket = prefill_ticket(state.connector, body, headers, wants_stream(body))
    limit = check_sampling(api, body)
    if ticket is not None:
        check_single_sequence(api, body)
        if (
            ticket.room is not None
            and ticket.key is not None
            and (ticket.key in state.rooms_in_flight or state.registry.lookup(ticket.key))
        ):
            raise BadRequest(f"bootstrap_room {ticket.room} is already in use on this prefill")
    if api is Api.GENERATE and wants_stream(body):
        raise BadRequest("the simulator does not stream /inference/v1/generate")
    return _Job(api, body, body_bytes, rank, ticket, limit, prompt_digest(api, body))


async def _run_prefill(
    state: PrefillState, job: _Job, request: web.Request, exchange: httpd.Exchange
) -> web.StreamResponse:
    generation = state.generation
    failure = await _compute(state, job, generation)
    if failure is not None:
        reply = httpd.error_response(500, failure, sglang=True)
        return exchange.reply(reply, "bootstrap_timeout")
    if generation != state.generation:
        reply = httpd.error_response(
            500, "engine restarted during prefill", sglang=state.sglang_errors
        )
        return exchange.reply(reply, "restarted")
    state.served_per_rank[job.rank] += 1
    if job.ticket is None:
        return await _answer(state, job, request, exchange, "no_kv", None)
    return await _hand_over_kv(state, job, job.ticket, request, exchange)


async def _compute(state: PrefillState, job: _Job, generation: int) -> str | None:
    """The prefill's compute (and an SGLang prefill's wait for its decode); why it failed,
    or None. A prefill cancelled meanwhile frees its KV, never ships it."""
    ticket = job.ticket
    try:
        await state.hang_gate.wait()
        await _compute_prompt(state, job)
        if ticket is not None and ticket.room is not None:
            return await _await_sglang_decode(state, ticket, job)
    except asyncio.CancelledError:
        # vLLM aborts a request whose client left; the KV is then freed, never shipped.
        if ticket is not None and ticket.key is not None and generation == state.generation:
            state.finish_transfer(ticket.key, _result(state, job, shipped=False))
        raise
    return None


async def _compute_prompt(state: PrefillState, job: _Job) -> None:
    """Wait for the rank (FIFO), then compute what the prefix cache does not hold."""
    slot = state.rank_slots[job.rank]
    caches = state.cache
    caches.waiting[job.rank] += 1
    try:
        if slot is not None:
            await slot.acquire()
    finally:
        caches.waiting[job.rank] -= 1
    caches.running[job.rank] += 1
    try:
        if not caches.enabled:
            await httpd.pause(state.compute_delay_s(job.body_bytes))
            return
        text = rendered_prompt(job.api, job.body)
        found = caches.lookup(job.rank, text)
        await httpd.pause(state.compute_delay_s(job.body_bytes, found))
        caches.count(job.rank, found)
        caches.store(job.rank, found.hashes)
        job.cached_tokens = found.cached_tokens
        job.prompt_tokens = found.prompt_tokens
    finally:
        caches.running[job.rank] -= 1
        if slot is not None:
            slot.release()


async def _hand_over_kv(
    state: PrefillState,
    job: _Job,
    ticket: PrefillTicket,
    request: web.Request,
    exchange: httpd.Exchange,
) -> web.StreamResponse:
    """Answer a prefill that holds KV for a decode, and record whether it ships."""
    # vLLM keeps KV for the decode only when the request finished length-capped at 1 token;
    # an SGLang prefill always hands its KV over, whatever the token limit.
    shipped = ticket.connector == SGLANG or job.limit == 1
    outcome = "shipped" if shipped else "not_shipped"
    if ticket.connector == NIXLV2:
        params = _finish_nixl(state, job, shipped)
        return await _answer(state, job, request, exchange, outcome, params)
    assert ticket.key is not None
    state.finish_transfer(ticket.key, _result(state, job, shipped))
    return await _answer(state, job, request, exchange, outcome, None)


def _result(
    state: PrefillState,
    job: _Job,
    shipped: bool,
    blocks: tuple[int, ...] = (),
    failure: str | None = None,
) -> TransferResult:
    request_id = job.ticket.request_id if job.ticket is not None else None
    engine_id = state.engine_ids[job.rank]
    return TransferResult(engine_id, job.rank, shipped, job.digest, blocks, request_id, failure)


async def _await_sglang_decode(state: PrefillState, ticket: PrefillTicket, job: _Job) -> str | None:
    """An SGLang prefill cannot send its KV before the decode has bootstrapped (sent the
    KV indices it allocated); it gives up like SGLang after the bootstrap timeout."""
    assert ticket.key is not None
    assert ticket.room is not None
    timeout_s = state.config.sglang_bootstrap_timeout_s
    outcome = await state.arrivals.wait(ticket.key, timeout_s)
    if isinstance(outcome, TransferResult):
        return None
    room = ticket.room
    reason = (
        f"Request {room} timed out after {timeout_s:.1f}s in KVPoll.Bootstrapping"
        if outcome == "timeout"
        else f"Request {room} aborted: {outcome}"
    )
    message = (
        f"Prefill bootstrap failed for request rank={job.rank} bootstrap_room={room} "
        f"with exception KVTransferError(bootstrap_room={room}): {reason}"
    )
    # A decode that bootstraps later finds the failure at once.
    state.finish_transfer(ticket.key, _result(state, job, shipped=False, failure=message))
    return message


def _finish_nixl(state: PrefillState, job: _Job, shipped: bool) -> JsonObject | None:
    """Register the blocks under a fresh vLLM request id and build the kv_transfer_params
    the prefill answers (vLLM NixlConnector's request_finished)."""
    assert job.ticket is not None
    base = job.ticket.request_id or uuid.uuid4().hex
    remote_request_id = f"{_ID_PREFIX[job.api]}-{base}-{uuid.uuid4().hex[:8]}"
    blocks = state.allocate_blocks(prompt_tokens_of(job))
    state.finish_transfer(remote_request_id, _result(state, job, shipped, blocks))
    if state.faults.kv_params == "missing":
        return None
    # Every field vLLM 0.32's NIXL scheduler answers (nixl/base_scheduler.py), in its order
    # and shapes: block ids come one list per KV cache group (one group here).
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(blocks)],
        "remote_engine_id": state.engine_ids[job.rank],
        "remote_request_id": remote_request_id,
        "remote_host": state.side_channel_host(),
        "remote_port": state.bootstrap_port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": prompt_tokens_of(job),
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": job.cached_tokens or 0,
    }


_ID_PREFIX = {
    Api.CHAT: "chatcmpl",
    Api.COMPLETIONS: "cmpl",
    Api.RESPONSES: "resp",
    Api.GENERATE: "generate",
}


def prompt_tokens_of(job: _Job) -> int:
    if job.prompt_tokens is not None:
        return job.prompt_tokens
    return prompt_tokens(job.api, job.body, job.body_bytes)


async def _answer(
    state: PrefillState,
    job: _Job,
    request: web.Request,
    exchange: httpd.Exchange,
    outcome: str,
    kv_params: JsonObject | None,
) -> web.StreamResponse:
    n_tokens = min(job.limit or state.config.default_tokens, MAX_GENERATED_TOKENS)
    if job.ticket is not None and job.ticket.connector == SGLANG:
        n_tokens = 1  # an SGLang prefill instance only produces the first token
    completion = Completion.for_request(
        job.api,
        job.body,
        job.body_bytes,
        n_tokens,
        job.limit,
        state.config.model,
        job.ticket.request_id if job.ticket is not None else None,
        cached_tokens=job.cached_tokens,
    )
    if job.prompt_tokens is not None:
        completion = dataclasses.replace(completion, prompt_tokens=job.prompt_tokens)
    exchange.outcome = outcome
    if wants_stream(job.body):
        response = await httpd.open_sse(request, exchange)
        return await httpd.stream_completion(exchange, response, completion, (0.0, 0.0))
    answer = completion.body()
    answer["kv_transfer_params"] = kv_params
    return exchange.reply(httpd.json_response(answer), outcome)


def build_prefill_app(state: PrefillState) -> web.Application:
    app = httpd.new_app()
    httpd.add_completion_routes(app, state, partial(_serve_completion, state))

    async def restart(_: web.Request) -> web.StreamResponse:
        state.restart()
        engine_ids = {str(rank): e for rank, e in enumerate(state.engine_ids)}
        return httpd.json_response({"engine_ids": engine_ids, "generation": state.generation})

    app.router.add_post("/sim/restart", restart)
    httpd.add_metrics_route(app, partial(engine_metrics.render, state.cache, state.config.model))
    httpd.add_model_routes(app, state.config.model)
    httpd.add_introspection_routes(app, state)
    return app


def build_bootstrap_app(state: PrefillState) -> web.Application:
    """The prefill's second server, where decodes find their KV: Mooncake's bootstrap server
    (GET /query) plus the sim's transfer rendezvous, NIXL's side channel, or SGLang's
    bootstrap server. The `bootstrap` faults act on /query and on the NIXL and SGLang routes."""
    app = httpd.new_app()
    if state.connector == MOONCAKE:
        app.router.add_get("/query", partial(_query, state))
        app.router.add_get("/sim/kv/{key}", partial(_mooncake_kv, state))
    elif state.connector == NIXLV2:
        app.router.add_get("/sim/nixl/{key}", partial(_nixl_read, state))
    else:
        app.router.add_get("/sim/sglang/{key}", partial(_sglang_room, state))
    return app


async def _bootstrap_fault(state: PrefillState) -> web.Response | None:
    await httpd.pause(state.faults.bootstrap_delay())
    mode = state.faults.bootstrap
    if mode == "down":
        return httpd.error_response(503, "bootstrap server unavailable (simulated)")
    if mode == "garbage":
        return web.Response(text="<html>not json", content_type="text/html")
    if mode == "empty":
        return httpd.json_response({})
    return None


async def _query(state: PrefillState, _: web.Request) -> web.StreamResponse:
    state.bootstrap_queries += 1
    return await _bootstrap_fault(state) or httpd.json_response(state.query_json())


def _timeout(request: web.Request, default: float) -> float:
    try:
        return float(request.query.get("timeout_s", default))
    except ValueError:
        raise web.HTTPBadRequest(text="timeout_s must be a number") from None


async def _mooncake_kv(state: PrefillState, request: web.Request) -> web.StreamResponse:
    """Long poll of a Mooncake decode for its transfer_id (its pull, simulated)."""
    state.kv_polls += 1
    key = request.match_info["key"]
    engine_id = request.query.get("engine_id")
    timeout_s = _timeout(request, 480.0)
    if engine_id and engine_id not in state.engine_ids:
        # The decode learnt this engine's side channel before the pod restarted (an engine
        # it never knew it looks up in /query first, and fails at once: decode.py). vLLM's
        # socket to the dead engine answers nothing: the decode waits for its abort timeout
        # (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s, + 60 s), however the new engine fares.
        outcome = await state.registry.wait(f"{engine_id}\n{key}", timeout_s)
        return _kv_miss(key, outcome if isinstance(outcome, str) else "timeout", engine_id)
    outcome = state.registry.lookup(key) or await state.registry.wait(key, timeout_s)
    if isinstance(outcome, str):
        return _kv_miss(key, outcome, engine_id)
    return httpd.json_response({"key": key, **outcome.to_json()})


async def _nixl_read(state: PrefillState, request: web.Request) -> web.StreamResponse:
    """A NIXL decode's handshake and block read: the prefill already answered (sequential
    legs), so the blocks are there or never will be; a read frees them."""
    state.kv_polls += 1
    fault = await _bootstrap_fault(state)
    if fault is not None:
        return fault
    key = request.match_info["key"]
    engine_id = request.query.get("engine_id")
    if engine_id and engine_id not in state.engine_ids:
        return _kv_miss(key, "unknown_engine", engine_id)
    found = state.registry.pop(key)
    if found is None:
        return _kv_miss(key, "unknown_request", engine_id)
    return httpd.json_response({"key": key, **found.to_json()})


async def _sglang_room(state: PrefillState, request: web.Request) -> web.StreamResponse:
    """An SGLang decode bootstraps (its prefill may now send) and waits for the room's KV."""
    state.kv_polls += 1
    fault = await _bootstrap_fault(state)
    if fault is not None:
        return fault
    key = request.match_info["key"]
    timeout_s = _timeout(request, 300.0)
    state.arrivals.complete(key, TransferResult("", 0, True))
    outcome = state.registry.lookup(key) or await state.registry.wait(key, timeout_s)
    if isinstance(outcome, str):
        return _kv_miss(key, outcome, None)
    return httpd.json_response({"key": key, **outcome.to_json()})


def _kv_miss(key: str, reason: str, engine_id: str | None) -> web.Response:
    body = {"key": key, "reason": reason, "engine_id": engine_id}
    return httpd.json_response(body, 404)
