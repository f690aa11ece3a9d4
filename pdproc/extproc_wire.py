"""Body messages on the ext_proc gRPC wire, read and written with one copy of the body.

protobuf's Python runtime copies a bytes field into the message when it parses it or is
given it, and again when the field is read back or the message serialised. A long prompt
went through pdproc as six full copies (two in, four out) before grpc had it. The messages
that carry a body are simple (a bytes field one to four levels down), so they are read and
written here by hand, and nothing else is: every other field still goes through protobuf.

Reading: a `ProcessingRequest` whose one `request` member is `request_body` becomes a
`BodyRequest`. A short message is parsed by protobuf (its copy of a few KiB costs less than
walking the fields in Python: the headers messages and a short prompt's body, most of the
traffic); a long one by hand (the body a view of the gRPC message, copied only if it is
needed as bytes; the message's other fields, if any, parsed by protobuf). Anything unusual
(a field spelled twice, an unexpected wire type, a group) is left to protobuf, so pdproc
reads exactly what protobuf reads.

Writing: a long body answer is written as two messages back to back, which protobuf reads
as one (an embedded message that appears twice is merged): protobuf serialises everything
but the body, and the body mutation is framed here around the body's pieces, joined once.
A short one is an ordinary protobuf message.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc.request_body import Buffer

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _number(message: type, name: str) -> int:
    number: int = message.DESCRIPTOR.fields_by_name[name].number  # type: ignore[attr-defined]
    return number


_REQUEST_BODY = _number(pb.ProcessingRequest, "request_body")
_REQUEST_ONEOF = frozenset(
    field.number for field in pb.ProcessingRequest.DESCRIPTOR.oneofs_by_name["request"].fields
)
_HTTP_BODY_BODY = _number(pb.HttpBody, "body")
_HTTP_BODY_END = _number(pb.HttpBody, "end_of_stream")
# Messages at least this long are read by hand: below it, protobuf's parse and copy take
# about 2 us against 7-10 us for the Python walk over the fields (timeit, 1 KiB body).
HAND_READ_BYTES = 64 * 1024
# Body answers at least this long are framed by hand (below it: 6 us against 11 us, 1 KiB).
HAND_WRITE_BYTES = 64 * 1024


class Body:
    """A request body message's content, and whether it ends the body. `view` is the
    content where gRPC received it (no copy: a streamed chunk is gathered from it); `body`
    is it as bytes, copied on first use (a buffered body is parsed and kept as bytes)."""

    __slots__ = ("_bytes", "end_of_stream", "view")

    def __init__(self, content: Buffer, end_of_stream: bool) -> None:
        self.view = memoryview(content)
        self.end_of_stream = end_of_stream
        self._bytes = content if isinstance(content, bytes) else None

    @property
    def body(self) -> bytes:
        if self._bytes is None:
            self._bytes = self.view.tobytes()
            self.view = memoryview(self._bytes)  # let gRPC's message go: one copy, not two
        return self._bytes

    def __len__(self) -> int:
        return len(self.view)

    def __repr__(self) -> str:
        return f"Body({len(self)} bytes, end_of_stream={self.end_of_stream})"


@dataclass(frozen=True, slots=True)
class BodyRequest:
    """A `ProcessingRequest` carrying a request body. `rest` holds its other fields (the
    attributes and metadata of single-message mode), parsed by protobuf."""

    request_body: Body
    rest: pb.ProcessingRequest


class _Irregular(Exception):
    """Not the plain shape read here: protobuf reads the message instead."""


def read_request(data: bytes) -> pb.ProcessingRequest | BodyRequest:
    """gRPC's deserializer for ext_proc requests. DecodeError when protobuf cannot parse
    the message either."""
    if len(data) >= HAND_READ_BYTES:
        try:
            return _read_body_request(memoryview(data))
        except _Irregular:
            pass
    message = pb.ProcessingRequest.FromString(data)
    if message.WhichOneof("request") != "request_body":
        return message
    body = message.request_body
    request = BodyRequest(Body(body.body, body.end_of_stream), message)
    message.ClearField("request_body")
    return request


def _read_body_request(view: memoryview) -> BodyRequest:
    body: Body | None = None
    rest: list[memoryview] = []
    for field, wire, start, value, end in _fields(view):
        if field in _REQUEST_ONEOF:
            if field != _REQUEST_BODY or wire != _LEN or body is not None:
                raise _Irregular
            body = _read_http_body(view[value:end])
        else:
            rest.append(view[start:end])
    if body is None:
        raise _Irregular
    other = pb.ProcessingRequest.FromString(b"".join(rest)) if rest else pb.ProcessingRequest()
    return BodyRequest(body, other)


def _read_http_body(view: memoryview) -> Body:
    span: tuple[int, int] | None = None
    end_of_stream = False
    seen: set[int] = set()
    for field, wire, _, value, end in _fields(view):
        if field in seen:
            raise _Irregular  # protobuf's last-one-wins (or merging) is left to protobuf
        seen.add(field)
        if field == _HTTP_BODY_BODY:
            if wire != _LEN:
                raise _Irregular
            span = (value, end)
        elif field == _HTTP_BODY_END:
            if wire != _VARINT:
                raise _Irregular
            end_of_stream = _varint(view, value)[0] != 0
    body = b"" if span is None else view[span[0] : span[1]]
    return Body(body, end_of_stream)


def _fields(view: memoryview) -> list[tuple[int, int, int, int, int]]:
    """A message's fields as (number, wire type, start, value start, end)."""
    fields = []
    position, size = 0, len(view)
    while position < size:
        start = position
        key, position = _varint(view, position)
        field, wire = key >> 3, key & 7
        value = position
        if wire == _VARINT:
            position = _varint(view, position)[1]
        elif wire == _LEN:
            length, value = _varint(view, position)
            position = value + length
        elif wire == _I64:
            position += 8
        elif wire == _I32:
            position += 4
        else:
            raise _Irregular  # groups
        if field == 0 or position > size:
            raise _Irregular
        fields.append((field, wire, start, value, position))
    return fields


def _varint(view: memoryview, position: int) -> tuple[int, int]:
    """The varint at `position`, and the position after it."""
    result = shift = 0
    for index in range(position, min(position + 10, len(view))):
        byte = view[index]
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, index + 1
        shift += 7
    raise _Irregular


@dataclass(frozen=True, slots=True)
class Encoded:
    """A `ProcessingResponse` already in wire form (a body answer)."""

    data: bytes

    def message(self) -> pb.ProcessingResponse:
        """The answer as protobuf reads it (for tests and logs)."""
        return pb.ProcessingResponse.FromString(self.data)


_RESPONSE_REQUEST_BODY = _number(pb.ProcessingResponse, "request_body")
_BODY_RESPONSE_RESPONSE = _number(pb.BodyResponse, "response")
_COMMON_BODY_MUTATION = _number(pb.CommonResponse, "body_mutation")
_BODY_MUTATION_BODY = _number(pb.BodyMutation, "body")


def body_answer(
    head: pb.ProcessingResponse, pieces: Sequence[Buffer]
) -> pb.ProcessingResponse | Encoded:
    """`head` (everything but the body: header mutations, metadata; used up) with a request
    body mutation that replaces the body by `pieces`, joined: the only copy of a long body.
    A short body is set on `head` and left to protobuf (its copy costs less than framing
    by hand)."""
    size = sum(len(piece) for piece in pieces)
    if size < HAND_WRITE_BYTES:
        head.request_body.response.body_mutation.body = b"".join(pieces)
        return head
    frames = []
    for number in (
        _BODY_MUTATION_BODY,
        _COMMON_BODY_MUTATION,
        _BODY_RESPONSE_RESPONSE,
        _RESPONSE_REQUEST_BODY,
    ):
        frame = _key(number, _LEN) + _encode_varint(size)
        frames.append(frame)
        size += len(frame)
    return Encoded(b"".join((head.SerializeToString(), *reversed(frames), *pieces)))


def _key(number: int, wire: int) -> bytes:
    return _encode_varint(number << 3 | wire)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def write_response(response: pb.ProcessingResponse | Encoded) -> bytes:
    """gRPC's serializer for ext_proc answers."""
    if isinstance(response, Encoded):
        return response.data
    data: bytes = response.SerializeToString()
    return data
