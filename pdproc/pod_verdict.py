"""What an exchange with a prefill pod says about the pod: one verdict, decided here only.

Every prefill outcome and every failed bootstrap query is turned into a `Verdict`; the
circuit breakers and the engine maps act on the verdict, never on raw outcomes. What a
verdict means for each:

| verdict       | breaker                     | engine map        |
|---------------|-----------------------------|-------------------|
| `HEALTHY`     | closes                      | kept              |
| `REFUSED`     | closes (the pod is up)      | dropped (stale?)  |
| `DOWN`        | opens at once               | kept              |
| `FAILED`      | counts toward its threshold | dropped           |
| `NOT_THE_POD` | untouched                   | kept              |

`DOWN` keeps the map: a port that refuses connections says nothing about the host's
bootstrap server, and any port of an allowed host can be named by a client. Pure logic.
"""

from __future__ import annotations

from enum import StrEnum, unique

from pdproc.outcomes import PrefillResult


@unique
class Verdict(StrEnum):
    HEALTHY = "healthy"  # the pod answered and served the request
    # The pod answered and refused the request (a 4xx): it is up, and the request is at
    # fault, but what pdproc told it (an engine id, a rank) may be stale.
    REFUSED = "refused"
    DOWN = "down"  # the pod cannot be reached at all
    FAILED = "failed"  # the pod was reached and failed (5xx, timeout, broken answer)
    # pdproc's own failure, its own exhaustion, or the client leaving: never held against
    # the pod.
    NOT_THE_POD = "not_the_pod"

    @property
    def pod_is_up(self) -> bool:
        return self is Verdict.HEALTHY or self is Verdict.REFUSED

    @property
    def map_may_be_stale(self) -> bool:
        """The pod may have restarted with new engine ids: ask its bootstrap server again."""
        return self is Verdict.REFUSED or self is Verdict.FAILED


_OF_PREFILL = {
    PrefillResult.OK: Verdict.HEALTHY,
    PrefillResult.CLIENT_ERROR: Verdict.REFUSED,
    PrefillResult.REDIRECT: Verdict.FAILED,
    PrefillResult.SERVER_ERROR: Verdict.FAILED,
    PrefillResult.TIMEOUT: Verdict.FAILED,
    PrefillResult.ERROR: Verdict.FAILED,
    PrefillResult.CONNECT_ERROR: Verdict.DOWN,
    PrefillResult.DEAD_PEER: Verdict.DOWN,
    PrefillResult.CANCELLED: Verdict.NOT_THE_POD,
    PrefillResult.EXHAUSTED: Verdict.NOT_THE_POD,
    PrefillResult.INTERNAL: Verdict.NOT_THE_POD,
}


def of_prefill(result: PrefillResult) -> Verdict:
    """What a prefill's outcome says about its pod."""
    return _OF_PREFILL[result]


def of_bootstrap(*, reached: bool, local: bool) -> Verdict:
    """What a failed bootstrap query says about the pod: `local` when pdproc itself ran out
    of resources, `reached` when the server could be connected to (and then failed)."""
    if local:
        return Verdict.NOT_THE_POD
    return Verdict.FAILED if reached else Verdict.DOWN
