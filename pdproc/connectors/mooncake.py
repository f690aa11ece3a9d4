"""vLLM's Mooncake connector: engine maps, rank choice and the two bodies, as pure functions.

The decode learns where to pull the KV from (`remote_bootstrap_addr`, `remote_engine_id`)
and which transfer it is (`transfer_id`); the prefill, sent at the same time to the rank
whose engine id the decode was given (`X-data-parallel-rank`), pushes that KV when it ends
after one token. See docs/protocol.md.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from pdproc.connectors import ClientRequest, Concurrent, EngineMap, Plan
from pdproc.errors import shown
from pdproc.request_body import KV_PARAMS, dumps, prime_single_token
from pdproc.targets import HostPort

RANK_HEADER = "x-data-parallel-rank"
# Bounds on a bootstrap server's answer: a prefill pod is trusted to be a prefill pod, not
# to be small. A real one has a handful of ranks and answers in a few hundred bytes.
MAX_QUERY_BYTES = 1024 * 1024
MAX_RANKS = 1024
MAX_ENGINE_ID_CHARS = 256


class BootstrapError(Exception):
    """The bootstrap server's answer cannot be used.

    `pod_down` says the server could not even be reached: the prefill pod itself is gone.
    `local` says pdproc itself ran out of resources (descriptors, memory): not the pod's
    fault, never held against it.
    """

    def __init__(self, message: str, *, pod_down: bool = False, local: bool = False) -> None:
        super().__init__(message)
        self.pod_down = pod_down
        self.local = local


def parse_engine_map(payload: bytes) -> EngineMap:
    """Parse `GET /query`: `{"<dp_rank>": {"engine_id": "<id>", "worker_addr": {...}}, ...}`.

    Ranks whose `engine_id` is a string are kept (a rank still registering may have none);
    a null rank is skipped; any other value means we misunderstand the server, so the whole
    answer is refused, as llm-d does. Keys must be integers: vLLM parses the rank header with
    `int()` and would silently ignore anything else, sending the prefill to a random rank.
    """
    if len(payload) > MAX_QUERY_BYTES:
        raise BootstrapError(f"bootstrap response larger than {MAX_QUERY_BYTES} bytes")
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise BootstrapError(f"failed to parse bootstrap response: {exc}") from None
    if not isinstance(data, dict):
        raise BootstrapError("failed to parse bootstrap response: not a JSON object")
    if len(data) > MAX_RANKS:
        raise BootstrapError(f"bootstrap response lists more than {MAX_RANKS} ranks")
    engines: EngineMap = {}
    for key, entry in data.items():
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise BootstrapError(
                f"failed to parse bootstrap response: rank {shown(key)} is not an object"
            )
        engine_id = entry.get("engine_id")
        if not isinstance(engine_id, str) or not engine_id:
            continue
        if len(engine_id) > MAX_ENGINE_ID_CHARS:
            raise BootstrapError("failed to parse bootstrap response: engine_id too long")
        if not (key.isascii() and key.isdigit()):
            continue
        engines[int(key)] = engine_id
    if not engines:
        raise BootstrapError("engine_id not found in bootstrap response")
    return engines


def pick_rank(
    engines: EngineMap, in_flight: Mapping[int, int], rng: random.Random | None = None
) -> tuple[int, str]:
    """Choose the (dp_rank, engine_id) for one request: the rank with the fewest prefills in
    flight from this processor, ties broken at random so replicas don't all pile onto rank 0.
    """
    fewest = min(in_flight.get(rank, 0) for rank in engines)
    candidates = [rank for rank in engines if in_flight.get(rank, 0) == fewest]
    rank = candidates[0] if len(candidates) == 1 else (rng or random).choice(candidates)
    return rank, engines[rank]


def new_transfer_id() -> str:
    return "xfer-" + str(uuid.uuid4())


def decode_params(transfer_id: str, bootstrap_addr: str, engine_id: str) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": bootstrap_addr,
        "remote_engine_id": engine_id,
    }


def prefill_params(transfer_id: str) -> dict[str, Any]:
    return {"do_remote_prefill": False, "do_remote_decode": True, "transfer_id": transfer_id}


def prefill_body(path: str, parsed: Mapping[str, Any], params: Mapping[str, Any]) -> bytes:
    """The body pdproc sends to the prefill pod: the client's, primed to produce one token."""
    data = {**parsed, KV_PARAMS: params}
    prime_single_token(path, data, parsed)
    return dumps(data)


class Mooncake(Concurrent):
    name = "mooncake"
    uses_engines = True

    def __init__(self, bootstrap_port: int) -> None:
        self.bootstrap_port = bootstrap_port

    def bootstrap_addr(self, target: HostPort) -> str:
        """The address the decode pod is told to pull KV from (IPv6 in brackets)."""
        return target.url(self.bootstrap_port)

    def plan(
        self, target: HostPort, engines: EngineMap | None, busy_ranks: Mapping[int, int]
    ) -> Plan:
        assert engines is not None, "Mooncake needs the prefill pod's engine map"
        rank, engine_id = pick_rank(engines, busy_ranks)
        transfer_id = new_transfer_id()
        return Plan(
            decode_fields={
                KV_PARAMS: decode_params(transfer_id, self.bootstrap_addr(target), engine_id)
            },
            prefill_headers={RANK_HEADER: str(rank)},
            rank=rank,
            facts={"transfer_id": transfer_id, "dp_rank": rank, "engine_id": engine_id},
        )

    def prefill_body(self, request: ClientRequest, plan: Plan, decode_body: bytes | None) -> bytes:
        transfer_id = str(plan.facts["transfer_id"])
        return prefill_body(request.path, request.parsed, prefill_params(transfer_id))
