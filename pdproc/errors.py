"""The error replies pdproc answers with itself: OpenAI-style bodies, in llm-d's shape.

Keys and their order follow llm-d (`object, message, type, param, code`, `param` an empty
string) so clients written against llm-d see the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import orjson


class ErrorKind(Enum):
    """Why pdproc answered a request itself. The value is the metrics/log label."""

    BAD_REQUEST = "bad_request"
    FORBIDDEN = "forbidden"
    TOO_LARGE = "too_large"
    BOOTSTRAP = "bootstrap_error"
    PREFILL_FAILED = "prefill_failed"
    PREFILL_TIMEOUT = "prefill_timeout"
    PREFILL_UNAVAILABLE = "prefill_unavailable"
    OVERLOADED = "overloaded"
    INTERNAL = "internal_error"


# (HTTP status, OpenAI error type) per kind.
_STATUS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.BAD_REQUEST: (400, "BadRequestError"),
    ErrorKind.FORBIDDEN: (403, "PermissionDeniedError"),
    ErrorKind.TOO_LARGE: (413, "RequestTooLargeError"),
    ErrorKind.BOOTSTRAP: (502, "BadGateway"),
    ErrorKind.PREFILL_FAILED: (502, "BadGateway"),
    ErrorKind.PREFILL_TIMEOUT: (504, "GatewayTimeout"),
    ErrorKind.PREFILL_UNAVAILABLE: (503, "ServiceUnavailable"),
    ErrorKind.OVERLOADED: (503, "ServiceUnavailable"),
    ErrorKind.INTERNAL: (500, "InternalServerError"),
}


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A complete error answer: what the client receives instead of the model's."""

    kind: ErrorKind
    message: str

    @property
    def status(self) -> int:
        return _STATUS[self.kind][0]

    @property
    def error_type(self) -> str:
        return _STATUS[self.kind][1]

    def body(self) -> bytes:
        return error_body(self.message, self.error_type, self.status)


def error_body(message: str, error_type: str, code: int) -> bytes:
    return orjson.dumps(
        {"object": "error", "message": message, "type": error_type, "param": "", "code": code}
    )


def shown(value: str, limit: int = 64) -> str:
    """A client- or pod-supplied value as it may appear in an answer or a log line: quoted
    (unprintable characters escaped) and cut short, so nobody can make pdproc echo (or log)
    kilobytes of their choosing."""
    text = repr(value)
    if len(text) <= limit + 2:
        return text
    return text[: limit + 1] + f"... ({len(value)} chars)"
