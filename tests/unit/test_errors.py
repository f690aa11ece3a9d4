from __future__ import annotations

import orjson

from pdproc.errors import ErrorKind, ErrorReply, error_body


def test_error_body_has_llm_d_shape_and_key_order() -> None:
    body = error_body("bad", "BadRequestError", 400)
    assert body == (
        b'{"object":"error","message":"bad","type":"BadRequestError","param":"","code":400}'
    )


def test_error_replies_map_kinds_to_status_and_type() -> None:
    cases = {
        ErrorKind.BAD_REQUEST: (400, "BadRequestError"),
        ErrorKind.FORBIDDEN: (403, "PermissionDeniedError"),
        ErrorKind.TOO_LARGE: (413, "RequestTooLargeError"),
        ErrorKind.BOOTSTRAP: (502, "BadGateway"),
        ErrorKind.PREFILL_FAILED: (502, "BadGateway"),
        ErrorKind.PREFILL_TIMEOUT: (504, "GatewayTimeout"),
    }
    for kind, (status, error_type) in cases.items():
        reply = ErrorReply(kind, "m")
        assert (reply.status, reply.error_type) == (status, error_type)
        assert orjson.loads(reply.body())["code"] == status


def test_messages_with_quotes_stay_valid_json() -> None:
    reply = ErrorReply(ErrorKind.BAD_REQUEST, 'invalid JSON: unexpected "\\" at 3')
    assert orjson.loads(reply.body())["message"] == 'invalid JSON: unexpected "\\" at 3'
