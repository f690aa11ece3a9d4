"""pdproc.extproc_wire reads and writes exactly what protobuf would: body requests against
protobuf's own parse of the same bytes, body answers against protobuf's own message."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from pdproc import extproc_wire
from pdproc._proto.envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc.extproc_wire import BodyRequest, Encoded, body_answer, read_request, write_response


@pytest.fixture(autouse=True, scope="module", params=["by-hand", "short-by-protobuf"])
def wire(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test runs twice: with every message read and every body answer written by
    hand (the path of long ones), and with the shipped thresholds (short ones by protobuf)."""
    shipped = extproc_wire.HAND_READ_BYTES, extproc_wire.HAND_WRITE_BYTES
    if request.param == "by-hand":
        extproc_wire.HAND_READ_BYTES = extproc_wire.HAND_WRITE_BYTES = 0
    try:
        yield request.param
    finally:
        extproc_wire.HAND_READ_BYTES, extproc_wire.HAND_WRITE_BYTES = shipped


# Body sizes around the varint boundaries of every length prefix.
SIZES = st.sampled_from([0, 1, 100, 116, 117, 127, 128, 16_370, 16_383, 16_384, 2_097_152])
BODIES = st.one_of(st.binary(max_size=300), SIZES.map(lambda size: b"x" * size))


def attributes(values: dict[str, str]) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    for key, value in values.items():
        request.attributes["envoy.filters.http.ext_proc"].fields[key].string_value = value
    return request


def equivalent(read: pb.ProcessingRequest | BodyRequest, data: bytes) -> None:
    """`read` is what protobuf reads from `data`, as pdproc hands it on."""
    expected = pb.ProcessingRequest.FromString(data)
    if expected.WhichOneof("request") != "request_body":
        assert read == expected
        return
    assert isinstance(read, BodyRequest)
    assert read.request_body.body == expected.request_body.body
    assert type(read.request_body.body) is bytes
    assert read.request_body.end_of_stream == expected.request_body.end_of_stream
    expected.ClearField("request_body")
    assert read.rest == expected


@given(BODIES, st.booleans(), st.dictionaries(st.text(max_size=20), st.text(max_size=20)))
def test_a_body_request_reads_as_protobuf_reads_it(
    body: bytes, end: bool, values: dict[str, str]
) -> None:
    message = attributes(values)
    message.request_body.body = body
    message.request_body.end_of_stream = end
    message.observability_mode = bool(values)
    data = message.SerializeToString()
    equivalent(read_request(data), data)


@given(st.lists(st.sampled_from(["headers", "body", "eos", "trailers", "attrs"]), max_size=6))
def test_odd_spellings_read_as_protobuf_reads_them(parts: list[str]) -> None:
    """Fields repeated, merged or in any order (two messages back to back are one message):
    whatever protobuf makes of them."""
    pieces = {
        "headers": pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=True)),
        "body": pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}")),
        "eos": pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True)),
        "trailers": pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
        "attrs": attributes({"request.path": "/v1/completions"}),
    }
    data = b"".join(pieces[part].SerializeToString() for part in parts)
    equivalent(read_request(data), data)


@given(st.binary(max_size=64))
def test_any_bytes_read_as_protobuf_reads_them_or_fail_as_it_does(data: bytes) -> None:
    try:
        pb.ProcessingRequest.FromString(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            read_request(data)
        return
    equivalent(read_request(data), data)


def test_a_body_with_unknown_fields_keeps_its_body() -> None:
    inner = pb.HttpBody(body=b"abc", end_of_stream=True).SerializeToString()
    inner += b"\x18\x05" + b"\x22\x02hi"  # fields 3 (varint) and 4 (bytes) of a newer Envoy
    data = b"\x22" + bytes([len(inner)]) + inner
    equivalent(read_request(data), data)


@pytest.mark.parametrize(
    "inner",
    [
        b"\x0a\x01a\x0a\x01b",  # the body twice: protobuf keeps the last
        b"\x10\x01\x10\x00",  # end_of_stream twice: the last again
        b"\x08\x05",  # the body as a varint: an unknown field to protobuf
        b"\x12\x01x",  # end_of_stream as bytes: an unknown field too
    ],
    ids=["body-twice", "end-twice", "body-varint", "end-bytes"],
)
def test_irregular_body_fields_read_as_protobuf_reads_them(inner: bytes) -> None:
    """Spellings Envoy never sends are left to protobuf, whose reading pdproc keeps."""
    data = b"\x22" + bytes([len(inner)]) + inner
    equivalent(read_request(data), data)


def test_a_body_is_read_where_grpc_received_it() -> None:
    """No copy on the way in: a streamed chunk is gathered straight from gRPC's bytes; the
    bytes form is made once, when asked for."""
    data = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * 70_000)).SerializeToString()
    read = read_request(data)
    assert isinstance(read, BodyRequest)
    body = read.request_body
    assert body.view.obj is data
    assert len(body) == 70_000
    assert repr(body) == "Body(70000 bytes, end_of_stream=False)"  # never the bytes in logs
    assert body.body == b"x" * 70_000
    assert body.body is body.body
    assert body.view.obj is body.body  # the message is no longer held


def heads() -> st.SearchStrategy[pb.ProcessingResponse]:
    def head(length: bool, request_id: str, checked: bool) -> pb.ProcessingResponse:
        response = pb.ProcessingResponse()
        mutation = response.request_body.response.header_mutation
        if length:
            value = HeaderValue(key="content-length", raw_value=b"12345")
            mutation.set_headers.append(HeaderValueOption(header=value))
        if request_id:
            value = HeaderValue(key="x-request-id", raw_value=request_id.encode())
            mutation.set_headers.append(HeaderValueOption(header=value))
        if not (length or request_id):
            response.ClearField("request_body")
        if checked:
            response.dynamic_metadata.update({"pdproc": {"body_checked": True}})
        return response

    return st.builds(head, st.booleans(), st.text(max_size=30), st.booleans())


@given(heads(), st.lists(BODIES, min_size=1, max_size=4))
def test_a_body_answer_is_the_message_protobuf_would_write(
    head: pb.ProcessingResponse, pieces: list[bytes]
) -> None:
    expected = pb.ProcessingResponse()
    expected.CopyFrom(head)
    expected.request_body.response.body_mutation.body = b"".join(pieces)
    answer = body_answer(head, [memoryview(piece) for piece in pieces])
    assert pb.ProcessingResponse.FromString(write_response(answer)) == expected
    long = sum(map(len, pieces)) >= extproc_wire.HAND_WRITE_BYTES
    assert isinstance(answer, Encoded) is long
    if isinstance(answer, Encoded):
        assert answer.message() == expected


def test_other_answers_are_serialised_by_protobuf() -> None:
    answer = pb.ProcessingResponse(request_body=pb.BodyResponse())
    assert write_response(answer) == answer.SerializeToString()
