"""KV connectors: what each prefill/decode protocol makes of one client request.

A connector is pure. Given the parsed request and the chosen prefill pod (and, for
Mooncake, the pod's engine map) it builds the prefill leg and, when the decode does not
depend on the prefill's answer, the decode leg too. Its kind says whether the prefill runs
before the decode (`Sequential`: NIXL v2, which also says what a failed prefill means for
the client) or beside it (`Concurrent`: Mooncake, SGLang). The processors know the kind,
never which connector runs; a new connector is one module here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, TypeAlias

from pdproc.request_body import ClientBytes, Pieces, with_fields
from pdproc.targets import HostPort

EngineMap = dict[int, str]
"""dp rank -> engine_id, as a prefill pod's Mooncake bootstrap server reports them."""


@dataclass(frozen=True, slots=True)
class ClientRequest:
    path: str
    raw: ClientBytes
    parsed: dict[str, Any]
    # The id both legs carry (Envoy's x-request-id).
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class Legs:
    """One disaggregated request's legs, built before Envoy gets its answer, so a body that
    cannot be built is the client's 400, never a failed prefill."""

    prefill_body: Pieces
    # None when the decode leg is built from the prefill's answer (sequential connectors),
    # or streamed to the decode with the plan's fields spliced into its tail.
    decode_body: bytes | None
    # Connector headers of the prefill request (the data-parallel rank, the request id), on
    # top of the client's end-to-end headers.
    prefill_headers: Mapping[str, str]
    rank: int | None = None
    # Facts for the log line and the span: transfer id, engine id, bootstrap room ...
    facts: Mapping[str, str | int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Plan:
    """What a concurrent connector decides before it sees the body: the fields the decode leg
    gets and all else about the legs that does not depend on the prompt. Fixed this early,
    a large body can flow on to the decode while it arrives (pdproc.streamed_body)."""

    decode_fields: Mapping[str, Any]
    prefill_headers: Mapping[str, str]
    rank: int | None = None
    facts: Mapping[str, str | int] = field(default_factory=dict)
    # What the connector keeps for the prefill leg (Mooncake: its kv_transfer_params).
    prefill_params: Mapping[str, Any] = field(default_factory=dict)


class AnswerError(ValueError):
    """A prefill's answer that the decode may not be given (wrong shape, too large, or a KV
    source outside what the gateway admits): the pod's fault, never the client's."""


class NoKvParams(AnswerError):
    """A prefill's answer without KV to hand over (vLLM answers `kv_transfer_params: null`
    when the prefill did not end length-capped): unusable, but not refused."""


class OnFailure(Enum):
    """What a failed prefill means for the client (sequential connectors: a concurrent
    connector's failed prefill always ends the request, its decode waiting for KV that
    will never come)."""

    PASS_THROUGH = "pass_through"  # the prefill's status (and JSON message) reach the client
    DECODE_ONLY = "decode_only"  # the decode serves the original request alone


class Sequential(Protocol):
    """A connector whose prefill runs to completion before the decode is sent: the decode
    leg is built from the prefill's answer (NIXL v2)."""

    name: str
    # Needs the prefill pod's engine map (pdproc.engine_maps) to build the legs.
    uses_engines: bool

    def legs(
        self,
        request: ClientRequest,
        target: HostPort,
        engines: EngineMap | None,
        in_flight_by_rank: Mapping[int, int],
    ) -> Legs:
        """The prefill leg (`decode_body` None); BodyError when the body cannot be carried."""
        ...

    def decode_body(
        self,
        request: ClientRequest,
        prefill_answer: bytes,
        target: HostPort,
        admits: Callable[[HostPort], bool],
    ) -> bytes:
        """The decode leg from the prefill pod `target`'s answer; AnswerError when the answer
        cannot be used (`admits`: whether the gateway would let an address be a KV source:
        the allow list and the pool)."""
        ...

    def on_failure(self, status: int | None) -> OnFailure:
        """What a prefill that failed (with this HTTP status, or none at all) means."""
        ...


class Concurrent:
    """Base of the connectors whose prefill runs beside the decode (Mooncake, SGLang): both
    legs are built up front, and a failed prefill ends the request, because the decode is
    already waiting for KV that will never come. The legs come from a `Plan` made before the
    body is read, so a large body can flow on to the decode while it arrives."""

    name: str
    uses_engines: bool = False

    def plan(
        self, target: HostPort, engines: EngineMap | None, in_flight_by_rank: Mapping[int, int]
    ) -> Plan:
        raise NotImplementedError

    def prefill_body(self, request: ClientRequest, plan: Plan, decode_body: bytes | None) -> Pieces:
        """The prefill leg (`decode_body`, when built, may be reused)."""
        raise NotImplementedError

    def decode_leg(self, request: ClientRequest, plan: Plan) -> bytes:
        """The decode leg: the client's body with the plan's decode fields."""
        return with_fields(request.raw, request.parsed, plan.decode_fields)

    def prefill_leg(self, request: ClientRequest, plan: Plan, decode_body: bytes | None) -> Legs:
        """The prefill leg; `decode_body` is the decode leg when it was built (None when the
        body is streamed to the decode with `plan.decode_fields` spliced into its tail)."""
        return Legs(
            prefill_body=self.prefill_body(request, plan, decode_body),
            decode_body=decode_body,
            prefill_headers=plan.prefill_headers,
            rank=plan.rank,
            facts=plan.facts,
        )


Connector: TypeAlias = Concurrent | Sequential
"""Every connector is one of the two kinds; the processor that runs a P/D pair is chosen by
the kind (pdproc.processors), never by the connector's name."""
