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


# OpenAI's error type per status, for a pod's refusal passed on with its own status.
_POD_STATUS_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
}
# The most of a pod's own message that reaches the client (quoted, see `shown`).
POD_MESSAGE_CHARS = 256


def pod_refusal_body(status: int, answer: bytes, content_type: str | None) -> bytes:
    """A pod's 4xx answer as the OpenAI-style error the client gets: the pod's status, and
    of its body only the message of an OpenAI-shaped JSON error (vLLM's `{"error":
    {"message": ...}}`, `{"error": "..."}` or `{"object": "error", "message": ...}`),
    quoted and cut short.
    Anything else the pod sent (HTML, text, other JSON) is dropped: a pod's body is never
    echoed as it came."""
    message = f"the prefill pod refused the request (status {status})"
    said = _pod_message(answer) if (content_type or "").startswith("application/json") else None
    if said:
        message += ": " + shown(said, POD_MESSAGE_CHARS)
    return error_body(message, _POD_STATUS_TYPES.get(status, "BadRequestError"), status)


def _pod_message(answer: bytes) -> str | None:
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(parsed, dict):
        return None
    inner = parsed.get("error")
    if isinstance(inner, str):
        return inner
    found = inner.get("message") if isinstance(inner, dict) else parsed.get("message")
    return found if isinstance(found, str) else None
