"""Simulated vLLM prefill instance (Mooncake kv_producer) and its bootstrap server."""

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

from pdproc_sim import httpd
from pdproc_sim.openai_shapes import (
    DEFAULT_MODEL,
    MAX_GENERATED_TOKENS,
    Api,
    BadRequest,
    Completion,
    check_sampling,
    check_single_sequence,
    role_kv_params,
    wants_stream,
)
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
# worker_addr ports are never dialled (the sim pulls KV over HTTP); they only fill the shape.
_FAKE_ZMQ_PORT_BASE = 50000


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


@dataclass(slots=True)
class PrefillFaults:
    prefill_status: int | None = None
    prefill_hang: bool = False
    prefill_fail_rate: float = 0.0
    bootstrap: str = "ok"
    bootstrap_delay_s: float | None = None

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


def _optional_delay(name: str, value: Any) -> float | None:
    return None if value is None else _number(name, value, 0, 3600)


_FAULT_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "prefill_status": fault_status,
    "prefill_hang": _boolean,
    "prefill_fail_rate": _fail_rate,
    "bootstrap": _bootstrap_mode,
    "bootstrap_delay_s": _optional_delay,
}


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


def prefill_transfer_id(body: JsonObject) -> str | None:
    """Check kv_transfer_params like vLLM's producer and the llm-d mock prefill."""
    params = role_kv_params(body, "prefill", remote_decode=True)
    if params is None:
        return None
    transfer_id = params.get("transfer_id")
    if not isinstance(transfer_id, str) or not transfer_id:
        raise BadRequest("Missing transfer_id in kv_transfer_params from router!")
    return transfer_id


class PrefillState(RoleState):
    role = "prefill"

    def __init__(self, config: PrefillConfig) -> None:
        super().__init__(config.record_limit, config.record_max_body_bytes)
        if config.dp_ranks < 1:
            raise ValueError("dp_ranks must be >= 1")
        self.config = config
        self.generation = 0
        self.engine_ids = make_engine_ids(config.engine_id_prefix, 0, config.dp_ranks)
        self.registry = TransferRegistry(config.kv_ttl_s, config.registry_cap)
        self.faults = PrefillFaults()
        self.bootstrap_port = 0
        # Set means "not hanging"; hung prefills wait on it and go on when the fault is lifted.
        self.hang_gate = asyncio.Event()
        self.hang_gate.set()
        self._round_robin = itertools.count()
        self._zero_counters()

    def _zero_counters(self) -> None:
        self.served_per_rank: collections.Counter[int] = collections.Counter()
        self.prefills_per_rank: collections.Counter[int] = collections.Counter()
        self.shipped = 0
        self.not_shipped = 0
        self.bootstrap_queries = 0
        self.kv_polls = 0
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

    def compute_delay_s(self, body_bytes: int) -> float:
        config = self.config
        return (config.prefill_delay_ms + config.prefill_ms_per_kib * body_bytes / 1024) / 1000

    def finish_transfer(self, transfer_id: str, rank: int, shipped: bool) -> None:
        result = TransferResult(self.engine_ids[rank], rank, shipped)
        self.registry.complete(transfer_id, result)
        self.prefills_per_rank[rank] += 1
        if shipped:
            self.shipped += 1
        else:
            self.not_shipped += 1

    def restart(self) -> None:
        """A pod restart: new engine ids, and every KV block (done or awaited) is gone."""
        self.generation += 1
        self.restarts += 1
        self.engine_ids = make_engine_ids(
            self.config.engine_id_prefix, self.generation, self.config.dp_ranks
        )
        self.registry.forget_all("prefill_restarted")

    def shutdown(self) -> None:
        self.registry.forget_all("shutdown")
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
            restarts=self.restarts,
            generation=self.generation,
            engine_ids={str(r): e for r, e in enumerate(self.engine_ids)},
            faults=self.faults_json(),
        )
        return stats

    def reset(self) -> None:
        super().reset()
        self._zero_counters()

    def faults_json(self) -> JsonObject:
        return dataclasses.asdict(self.faults)

    def apply_faults(self, patch: JsonObject) -> None:
        self.faults = _patched_faults(self.faults, patch)
        if self.faults.prefill_hang:
            self.hang_gate.clear()
        else:
            self.hang_gate.set()


@dataclass(frozen=True, slots=True)
class _Job:
    """A validated prefill request."""

    api: Api
    body: JsonObject
    body_bytes: int
    rank: int
    transfer_id: str | None
    limit: int | None


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
    return await _run_prefill(state, job, request, exchange)


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
    transfer_id = prefill_transfer_id(body)
    limit = check_sampling(api, body)
    if transfer_id is not None:
        check_single_sequence(api, body)
    if api is Api.GENERATE and wants_stream(body):
        raise BadRequest("the simulator does not stream /inference/v1/generate")
    return _Job(api, body, body_bytes, rank, transfer_id, limit)


async def _run_prefill(
    state: PrefillState, job: _Job, request: web.Request, exchange: httpd.Exchange
) -> web.StreamResponse:
    generation = state.generation
    try:
        await state.hang_gate.wait()
        await httpd.pause(state.compute_delay_s(job.body_bytes))
    except asyncio.CancelledError:
        # vLLM aborts a request whose client left; the KV is then freed, never shipped.
        if job.transfer_id is not None and generation == state.generation:
            state.finish_transfer(job.transfer_id, job.rank, shipped=False)
        raise
    if generation != state.generation:
        return exchange.reply(
            httpd.error_response(500, "engine restarted during prefill"), "restarted"
        )
    outcome = "no_kv"
    if job.transfer_id is not None:
        # vLLM keeps KV for the decode only when the request finished length-capped at 1 token.
        shipped = job.limit == 1
        state.finish_transfer(job.transfer_id, job.rank, shipped)
        outcome = "shipped" if shipped else "not_shipped"
    state.served_per_rank[job.rank] += 1
    return await _answer(state, job, request, exchange, outcome)


async def _answer(
    state: PrefillState, job: _Job, request: web.Request, exchange: httpd.Exchange, outcome: str
) -> web.StreamResponse:
    n_tokens = min(job.limit or state.config.default_tokens, MAX_GENERATED_TOKENS)
    completion = Completion.for_request(
        job.api, job.body, job.body_bytes, n_tokens, job.limit, state.config.model
    )
    exchange.outcome = outcome
    if wants_stream(job.body):
        response = await httpd.open_sse(request, exchange)
        return await httpd.stream_completion(exchange, response, completion, (0.0, 0.0))
    return exchange.reply(httpd.json_response(completion.body()), outcome)


def build_prefill_app(state: PrefillState) -> web.Application:
    app = httpd.new_app()
    httpd.add_completion_routes(app, state, partial(_serve_completion, state))

    async def restart(_: web.Request) -> web.StreamResponse:
        state.restart()
        engine_ids = {str(rank): e for rank, e in enumerate(state.engine_ids)}
        return httpd.json_response({"engine_ids": engine_ids, "generation": state.generation})

    app.router.add_post("/sim/restart", restart)
    httpd.add_model_routes(app, state.config.model)
    httpd.add_introspection_routes(app, state)
    return app


def build_bootstrap_app(state: PrefillState) -> web.Application:
    """MooncakeBootstrapServer's GET /query, plus the sim's KV rendezvous for decodes."""
    app = httpd.new_app()

    async def query(_: web.Request) -> web.StreamResponse:
        state.bootstrap_queries += 1
        await httpd.pause(state.faults.bootstrap_delay())
        mode = state.faults.bootstrap
        if mode == "down":
            return httpd.error_response(503, "bootstrap server unavailable (simulated)")
        if mode == "garbage":
            return web.Response(text="<html>not json", content_type="text/html")
        if mode == "empty":
            return httpd.json_response({})
        return httpd.json_response(state.query_json())

    async def kv(request: web.Request) -> web.StreamResponse:
        return await _kv_poll(state, request)

    app.router.add_get("/query", query)
    app.router.add_get("/sim/kv/{transfer_id}", kv)
    return app


async def _kv_poll(state: PrefillState, request: web.Request) -> web.StreamResponse:
    state.kv_polls += 1
    transfer_id = request.match_info["transfer_id"]
    engine_id = request.query.get("engine_id")
    try:
        timeout_s = float(request.query.get("timeout_s", "480"))
    except ValueError:
        return httpd.error_response(400, "timeout_s must be a number")
    found = state.registry.lookup(transfer_id)
    if found is None and engine_id and engine_id not in state.engine_ids:
        # vLLM's decode looks the engine up in /query first and fails at once if it is gone.
        return _kv_miss(transfer_id, "unknown_engine", engine_id)
    outcome = found or await state.registry.wait(transfer_id, timeout_s)
    if isinstance(outcome, str):
        return _kv_miss(transfer_id, outcome, engine_id)
    return httpd.json_response({"transfer_id": transfer_id, **outcome.to_json()})


def _kv_miss(transfer_id: str, reason: str, engine_id: str | None) -> web.Response:
    body = {"transfer_id": transfer_id, "reason": reason, "engine_id": engine_id}
    return httpd.json_response(body, 404)
