"""The ext_proc messages pdproc reads and writes (pdproc.extproc_messages), against the rules
Envoy enforces: header values in raw_value, content-length with a rewritten body while the
headers are held, the checked mark only on bodies pdproc checked."""

from __future__ import annotations

import orjson
import pytest

from pdproc import extproc_messages as msg
from pdproc._proto.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc._proto.google.protobuf.struct_pb2 import Struct
from pdproc.errors import ErrorKind, ErrorReply
from pdproc.extproc_wire import write_response
from pdproc.targets import PREFILL_HEADER


def wire(answer: msg.Answer) -> pb.ProcessingResponse:
    """The answer as Envoy reads it."""
    return pb.ProcessingResponse.FromString(write_response(answer))


def set_headers(response: msg.Answer, part: str) -> dict[str, bytes]:
    common = getattr(wire(response), part).response
    return {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}


def checked(response: msg.Answer) -> bool:
    fields = wire(response).dynamic_metadata.fields
    return (
        msg.METADATA_NAMESPACE in fields
        and fields[msg.METADATA_NAMESPACE].struct_value.fields[msg.METADATA_CHECKED_KEY].bool_value
    )


def test_every_headers_answer_strips_the_prefill_header() -> None:
    for answer in (
        msg.CONTINUE_REQUEST_HEADERS,
        msg.PASS_THROUGH_HEADERS,
        msg.CHECK_BODY_ONLY_HEADERS,
        msg.STREAMED_HEADERS,
    ):
        removed = answer.request_headers.response.header_mutation.remove_headers
        assert PREFILL_HEADER in removed


def test_a_rewritten_body_with_headers_held_sets_its_length_and_the_request_id() -> None:
    answer = msg.body_response(b'{"a":1}', content_length=True, request_id="pd-1")
    assert set_headers(answer, "request_body") == {
        "content-length": b"7",
        "x-request-id": b"pd-1",
    }
    assert wire(answer).request_body.response.body_mutation.body == b'{"a":1}'
    assert checked(answer)


def test_a_rewritten_body_in_single_message_mode_sets_no_header() -> None:
    answer = msg.body_response(b"{}", content_length=False, request_id="ignored")
    assert set_headers(answer, "request_body") == {}
    assert checked(answer)


def test_a_body_passed_on_unchanged_is_marked_checked() -> None:
    assert msg.checked_request_body(None) is msg.CHECKED_REQUEST_BODY
    assert checked(msg.CHECKED_REQUEST_BODY)
    with_id = msg.checked_request_body("pd-2")
    assert set_headers(with_id, "request_body") == {"x-request-id": b"pd-2"}
    assert checked(with_id)
    assert not checked(msg.CONTINUE_REQUEST_BODY)


def test_streamed_chunks() -> None:
    assert msg.chunk_response(None) is msg.CONTINUE_REQUEST_BODY
    assert wire(msg.chunk_response(b"")).request_body.response.body_mutation.clear_body
    assert wire(msg.chunk_response(b"ab")).request_body.response.body_mutation.body == b"ab"
    part = memoryview(b"abcd")[1:3]
    assert wire(msg.chunk_response(part)).request_body.response.body_mutation.body == b"bc"
    assert not checked(msg.chunk_response(b"ab"))  # only the last chunk is marked
    last = msg.last_chunk_response((memoryview(b"xa"), b",", b"}"))
    assert wire(last).request_body.response.body_mutation.body == b"xa,}"
    assert checked(last)
    nothing = msg.last_chunk_response((b"", memoryview(b"")))
    assert wire(nothing).request_body.response.body_mutation.clear_body
    assert checked(nothing)


def test_an_error_answer_is_openai_shaped_and_labelled() -> None:
    answer = msg.immediate(ErrorReply(ErrorKind.PREFILL_TIMEOUT, "prefill timed out"))
    immediate = answer.immediate_response
    assert immediate.status.code == 504
    assert immediate.details == "pdproc_prefill_timeout"
    headers = {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}
    assert headers == {"content-type": b"application/json", "x-pdproc-error": b"prefill_timeout"}
    assert orjson.loads(immediate.body)["type"] == "GatewayTimeout"


@pytest.mark.parametrize(
    ("status", "answer", "content_type", "error_type", "said"),
    [
        (400, b"<html><script>alert(1)</script></html>", "text/html", "BadRequestError", None),
        (400, b"too long", "text/plain", "BadRequestError", None),
        (400, b"too long", None, "BadRequestError", None),
        (
            422,
            b'{"error":{"message":"bad field"}}',
            "application/json",
            "UnprocessableEntityError",
            "bad field",
        ),
        (
            400,
            b'{"object":"error","message":"too long"}',
            "application/json; charset=utf-8",
            "BadRequestError",
            "too long",
        ),
        (
            429,
            b'{"message":"<script>x</script>"}',
            "application/json",
            "RateLimitError",
            "<script>x</script>",
        ),
        (451, b'{"error":' * 2000, "application/json", "BadRequestError", None),
        (400, b'["a list"]', "application/json", "BadRequestError", None),
    ],
)
def test_a_pods_refusal_is_a_json_error_with_its_status_never_its_body(
    status: int, answer: bytes, content_type: str | None, error_type: str, said: str | None
) -> None:
    immediate = msg.passed_through(status, answer, content_type).immediate_response
    assert immediate.status.code == status
    headers = {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}
    assert headers["content-type"] == b"application/json"
    error = orjson.loads(immediate.body)
    assert (error["object"], error["type"], error["code"]) == ("error", error_type, status)
    assert error["message"].startswith(f"the prefill pod refused the request (status {status})")
    if said is None:
        assert answer.decode(errors="replace") not in immediate.body.decode()
    else:
        # Quoted as a JSON string: never markup the client's browser would run as served.
        assert repr(said) in error["message"]


def test_a_pods_long_message_is_cut_short() -> None:
    answer = orjson.dumps({"error": {"message": "x" * 100_000}})
    body = msg.passed_through(400, answer, "application/json").immediate_response.body
    assert len(body) < 600


def test_hold_asks_for_seconds_and_nanos() -> None:
    timeout = msg.hold(61.25).override_message_timeout
    assert (timeout.seconds, timeout.nanos) == (61, 250_000_000)


def test_header_dict_joins_repeated_names_and_reads_either_value_field() -> None:
    headers = pb.HttpHeaders(
        headers=HeaderMap(
            headers=[
                HeaderValue(key="accept", raw_value=b"a"),
                HeaderValue(key="accept", value="b"),
                HeaderValue(key="x-latin", raw_value="é".encode("latin-1")),
            ]
        )
    )
    assert msg.header_dict(headers) == {"accept": "a,b", "x-latin": "é"}


def test_status_of_a_response() -> None:
    raw = pb.HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=":status", raw_value=b"503")]))
    plain = pb.HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=":status", value="200")]))
    assert msg.status_of(raw) == "503"
    assert msg.status_of(plain) == "200"
    assert msg.status_of(pb.HttpHeaders()) == ""


def attributes_request(
    fields: dict[str, str], metadata: dict[str, object] | None = None
) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True))
    attributes = Struct()
    attributes.update(fields)
    request.attributes[msg.ATTRIBUTES_KEY].CopyFrom(attributes)
    if metadata is not None:
        namespace = Struct()
        namespace.update(metadata)
        request.metadata_context.filter_metadata[msg.METADATA_NAMESPACE].CopyFrom(namespace)
    return request


def test_headers_rebuilt_from_single_message_attributes() -> None:
    request = attributes_request(
        {
            "request.path": "/v1/completions",
            "request.method": "POST",
            "request.id": "req-9",
            "request.headers['authorization']": "Bearer t",
            "request.headers['X-Custom']": "v",
            "request.headers[':authority']": "ignored",
            "request.headers['']": "ignored",
        },
        {msg.METADATA_PREFILL_KEY: "10.0.0.1:8000"},
    )
    assert msg.headers_from_attributes(request) == {
        ":path": "/v1/completions",
        ":method": "POST",
        "x-request-id": "req-9",
        "authorization": "Bearer t",
        "x-custom": "v",
        PREFILL_HEADER: "10.0.0.1:8000",
    }


def test_an_empty_prefill_header_is_still_seen_in_single_message_mode() -> None:
    request = attributes_request(
        {"request.path": "/v1/completions"}, {msg.METADATA_PREFILL_PRESENT_KEY: True}
    )
    assert msg.headers_from_attributes(request) == {":path": "/v1/completions", PREFILL_HEADER: ""}


def test_no_attributes_means_two_message_mode() -> None:
    assert msg.headers_from_attributes(pb.ProcessingRequest()) is None
    assert msg.headers_from_attributes(attributes_request({"request.method": "POST"})) is None
