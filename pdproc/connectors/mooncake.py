"""vLLM's Mooncake connector: engine maps, rank choice and the two bodies, as pure functions.

The decode learns where to pull the KV from (`remote_bootstrap_addr`, `remote_engine_id`)
and which transfer it is (`transfer_id`); the prefill, sent at the same time to the rank
whose engine id the decode was given (`X-data-parallel-rank`), pushes that KV when it ends
after one token. See docs/protocol.md.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from typing import Any

from pdproc.connectors import ClientRequest, Concurrent, EngineMap, Plan
from pdproc.request_body import KV_PARAMS, Pieces, dump_pieces, prime_single_token
from pdproc.targets import HostPort

RANK_HEADER = "x-data-parallel-rank"


def pick_rank(
    engines: EngineMap, in_flight_by_rank: Mapping[int, int], rng: random.Random | None = None
) -> tuple[int, str]:
    """Choose the (dp_rank, engine_id) for one request: the rank with the fewest prefills in
    flight from this processor, ties broken at random so replicas don't all pile onto rank 0.
    """
    fewest = min(in_flight_by_rank.get(rank, 0) for rank in engines)
    candidates = [rank for rank in engines if in_flight_by_rank.get(rank, 0) == fewest]
    rank = candidates[0] if len(candidates) == 1 else (rng or random).choice(candidates)
    return rank, engines[rank]


def new_transfer_id() -> str:
    """`xfer-` and a random (version 4) UUID, as text. Written from the random bytes
    directly: uuid.uuid4() builds and checks a UUID object only to print it, as much
    Python as the rest of the connector's work per request."""
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # the RFC 4122 variant
    h = raw.hex()
    return f"xfer-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


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


def prefill_body(path: str, parsed: Mapping[str, Any], params: Mapping[str, Any]) -> Pieces:
    """The body pdproc sends to the prefill pod: the client's, primed to produce one token."""
    data = {**parsed, KV_PARAMS: params}
    prime_single_token(path, data, parsed)
    return dump_pieces(data)


class Mooncake(Concurrent):
    name = "mooncake"
    uses_engines = True

    def __init__(self, bootstrap_port: int) -> None:
        self.bootstrap_port = bootstrap_port

    def bootstrap_addr(self, target: HostPort) -> str:
        """The address the decode pod is told to pull KV from (IPv6 in brackets)."""
        return target.url(self.bootstrap_port)

    def plan(
        self, target: HostPort, engines: EngineMap | None, in_flight_by_rank: Mapping[int, int]
    ) -> Plan:
        assert engines is not None, "Mooncake needs the prefill pod's engine map"
        rank, engine_id = pick_rank(engines, in_flight_by_rank)
        transfer_id = new_transfer_id()
        return Plan(
            prefill_params=prefill_params(transfer_id),
            decode_fields={
                KV_PARAMS: decode_params(transfer_id, self.bootstrap_addr(target), engine_id)
            },
            prefill_headers={RANK_HEADER: str(rank)},
            rank=rank,
            facts={"transfer_id": transfer_id, "dp_rank": rank, "engine_id": engine_id},
        )

    def prefill_body(self, request: ClientRequest, plan: Plan, decode_body: bytes | None) -> Pieces:
        return prefill_body(request.path, request.parsed, plan.prefill_params)
