"""SGLang's disaggregation: both legs get the same body, launched side by side.

The decode learns where the prefill pod's bootstrap server is (`bootstrap_host`,
`bootstrap_port`) and which rendezvous to wait in (`bootstrap_room`, a random integer below
2**63); the prefill gets exactly the same body and meets it there. SGLang's prefill server
needs no priming: it computes the prompt and hands the KV over on its own. A client's own
bootstrap fields never get this far: `request_body.parse_body` refuses them on every path.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from pdproc.connectors import ClientRequest, Concurrent, EngineMap, Plan
from pdproc.request_body import Pieces, with_fields
from pdproc.targets import HostPort


def new_room() -> int:
    return secrets.randbelow(2**63)


class SGLang(Concurrent):
    name = "sglang"
    uses_engines = False

    def __init__(self, bootstrap_port: int) -> None:
        self.bootstrap_port = bootstrap_port

    def plan(
        self, target: HostPort, engines: EngineMap | None, in_flight_by_rank: Mapping[int, int]
    ) -> Plan:
        room = new_room()
        return Plan(
            decode_fields={
                "bootstrap_host": target.host,
                "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": room,
            },
            prefill_headers={},
            facts={"bootstrap_room": room},
        )

    def prefill_body(self, request: ClientRequest, plan: Plan, decode_body: bytes | None) -> Pieces:
        # The prefill meets the decode in the same room: it gets the same body.
        if decode_body is not None:
            return Pieces((decode_body,))
        return Pieces((with_fields(request.raw, request.parsed, plan.decode_fields),))
