"""What a request and a prefill end as: the domain's outcomes, one enum each.

`Outcome` is what a request is counted as (exactly one per request, see ledger.py) and
`PrefillResult` what a prefill is counted as. Their values are the label values of
pdproc_requests_total and pdproc_prefills_total that dashboards and alerts use, so an
existing value never changes.
"""

from __future__ import annotations

from enum import StrEnum, unique

from pdproc.errors import ErrorKind


@unique
class Outcome(StrEnum):
    """Every outcome a request is counted as (pdproc_requests_total's `outcome`), exactly one
    per request (pdproc.ledger). The values are the label values dashboards and alerts use."""

    PD = "pd"  # prefill and decode both answered
    PASSTHROUGH = "passthrough"  # not disaggregated: not a P/D request, no target, or draining
    DECODE_ONLY = "decode_only"  # a fallback: the decode served it alone (prefill unusable)
    SHORT_PROMPT = "short_prompt"  # below --pd-min-prompt: the decode served it alone
    # The decode pdproc named holds most of the prompt (--decode-skip-pd-fraction): it
    # served it alone, no prefill sent. A success, like pd.
    DECODE_CACHED = "decode_cached"
    UNFINISHED_BODY = "unfinished_body"  # a streamed body answered before it ended
    ABANDONED = "abandoned"  # the client left before the decode's answer reached it
    CANCELLED = "cancelled"  # the same, and pdproc cancelled its running prefill
    # The prefill's answer was unfit for the decode (NIXL): the decode served it alone.
    PREFILL_ANSWER_REFUSED = "prefill_answer_refused"
    # Answered by pdproc itself: one per ErrorKind, same value (`Outcome.of`).
    BAD_REQUEST = ErrorKind.BAD_REQUEST.value
    FORBIDDEN = ErrorKind.FORBIDDEN.value
    TOO_LARGE = ErrorKind.TOO_LARGE.value
    BOOTSTRAP_ERROR = ErrorKind.BOOTSTRAP.value
    PREFILL_FAILED = ErrorKind.PREFILL_FAILED.value
    PREFILL_TIMEOUT = ErrorKind.PREFILL_TIMEOUT.value
    PREFILL_UNAVAILABLE = ErrorKind.PREFILL_UNAVAILABLE.value
    OVERLOADED = ErrorKind.OVERLOADED.value
    INTERNAL_ERROR = ErrorKind.INTERNAL.value

    @staticmethod
    def of(kind: ErrorKind) -> Outcome:
        """The outcome of a request pdproc answered itself with an error of `kind`."""
        return _ERROR_OUTCOMES[kind]


_ERROR_OUTCOMES = {kind: Outcome(kind.value) for kind in ErrorKind}


@unique
class PrefillResult(StrEnum):
    """Every outcome of a prefill (pdproc_prefills_total's `outcome`)."""

    OK = "2xx"
    REDIRECT = "3xx"
    CLIENT_ERROR = "4xx"
    SERVER_ERROR = "5xx"
    TIMEOUT = "timeout"
    CONNECT_ERROR = "connect_error"
    # Sent, then the pod's node stopped acknowledging (--dead-peer-timeout): the pod is down.
    DEAD_PEER = "dead_peer"
    ERROR = "error"
    CANCELLED = "cancelled"  # the client left: pdproc cancelled it (never held against the pod)
    EXHAUSTED = "exhausted"  # pdproc out of descriptors or memory (never held against the pod)
    INTERNAL = "internal"  # a bug in pdproc (never held against the pod)

    @staticmethod
    def of_status(status: int) -> PrefillResult:
        """The outcome of a prefill answered with HTTP `status` (an interim 1xx as a final
        answer is no HTTP status class pdproc expects: an error)."""
        if status < 200:
            return PrefillResult.ERROR
        if status < 300:
            return PrefillResult.OK
        if status < 400:
            return PrefillResult.REDIRECT
        return PrefillResult.CLIENT_ERROR if status < 500 else PrefillResult.SERVER_ERROR


# The label values, in declaration order (the metrics' help text lists them).
REQUEST_OUTCOMES: tuple[str, ...] = tuple(outcome.value for outcome in Outcome)
PREFILL_OUTCOMES: tuple[str, ...] = tuple(result.value for result in PrefillResult)
