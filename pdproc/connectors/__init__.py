"""KV connectors: what each prefill/decode protocol makes of one client request.

A connector is pure: given the parsed request, the chosen prefill pod and (for Mooncake)
its engine map, it returns both legs' bodies and headers. The ext_proc stream does not know
which connector it runs; it launches the prefill leg and hands the decode leg to Envoy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdproc.targets import HostPort

EngineMap = dict[int, str]
"""dp rank -> engine_id, as a prefill pod's Mooncake bootstrap server reports them."""


@dataclass(frozen=True, slots=True)
class ClientRequest:
    path: str
    raw: bytes
    parsed: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Legs:
    """Both legs of one disaggregated request, built before Envoy gets its answer, so a body
    that cannot be built is the client's 400, never a failed prefill."""

    decode_body: bytes
    prefill_body: bytes
    # Connector headers of the prefill request (the data-parallel rank), on top of the
    # client's end-to-end headers.
    prefill_headers: Mapping[str, str]
    rank: int | None = None
    # Facts for the log line and the span: transfer id, engine id ...
    facts: Mapping[str, str | int] = field(default_factory=dict)


class Connector(Protocol):
    name: str
    # Needs the prefill pod's engine map (Mooncake's bootstrap /query) to build the legs.
    uses_engines: bool

    def legs(
        self,
        request: ClientRequest,
        target: HostPort,
        engines: EngineMap | None,
        busy_ranks: Mapping[int, int],
    ) -> Legs:
        """Both legs; BodyError when the client's body cannot be carried."""
        ...
