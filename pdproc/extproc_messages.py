"""Envoy's ext_proc protocol messages, read and written: pure functions and constant answers.

Everything pdproc says to Envoy is built here and nowhere else. The rules Envoy enforces
(docs/extproc-rules.md): header values go in `raw_value`; a body mutation with the request
headers still held sets `content-length`; modes in a `mode_override` are absolute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

from pdproc._proto.envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from pdproc._proto.envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import (
    ProcessingMode,
)
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc._proto.envoy.type.v3.http_status_pb2 import HttpStatus
from pdproc.errors import ErrorReply, pod_refusal_body
from pdproc.extproc_wire import Encoded, body_answer
from pdproc.request_body import Buffer
from pdproc.targets import PREFILL_HEADER

# An answer to Envoy, the one name for one: a message, or a body answer already in wire
# form (pdproc.extproc_wire). A processor may also answer later (pdproc.processors.Deferred).
Answer: TypeAlias = pb.ProcessingResponse | Encoded

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_STRIP_PREFILL_HEADER = pb.HeaderMutation(remove_headers=[PREFILL_HEADER])

# Single-message mode: what Envoy sends as request_attributes instead of a headers message
# (`pdproc envoy-config --single-message` lists exactly these), and the metadata namespace
# where a header_to_metadata filter puts the endpoint picker's prefill header.
ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
ATTRIBUTE_HEADERS = ("authorization", "traceparent", "tracestate", "baggage")
REQUEST_ATTRIBUTES = (
    "request.path",
    "request.method",
    "request.id",
    *(f"request.headers['{name}']" for name in ATTRIBUTE_HEADERS),
)
_HEADER_ATTRIBUTE = "request.headers['"
METADATA_NAMESPACE = "pdproc"
METADATA_PREFILL_KEY = "prefiller"
# Set whenever the header was sent, even empty (header_to_metadata skips empty values).
METADATA_PREFILL_PRESENT_KEY = "prefiller_present"
# Body answers for a body pdproc has checked carry this mark, so a rule after ext_proc can
# refuse client-chosen kv_transfer_params on requests pdproc never saw (it failed open).
METADATA_CHECKED_KEY = "body_checked"
# The decode pdproc names for the request (--decode-choice prefix), as IP:PORT: the decode
# cluster's override_host policy routes to it (pdproc envoy-config --decode-choice prefix).
METADATA_DECODE_KEY = "decode_endpoint"


def _checked_mark() -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    response.dynamic_metadata.update({METADATA_NAMESPACE: {METADATA_CHECKED_KEY: True}})
    return response


_CHECKED = _checked_mark().dynamic_metadata


def _marked(response: pb.ProcessingResponse, decode: str | None) -> pb.ProcessingResponse:
    """The body is checked (and, when given, `decode` is the decode to route to)."""
    if decode is None:
        response.dynamic_metadata.CopyFrom(_CHECKED)
    else:
        marks = {METADATA_CHECKED_KEY: True, METADATA_DECODE_KEY: decode}
        response.dynamic_metadata.update({METADATA_NAMESPACE: marks})
    return response


# Answers that never change, built once.
CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=_STRIP_PREFILL_HEADER)
    )
)
# Not P/D: stop buffering the body and skip the response phase (needs allow_mode_override).
PASS_THROUGH_HEADERS = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=_STRIP_PREFILL_HEADER)
    ),
    mode_override=ProcessingMode(
        request_body_mode=ProcessingMode.NONE, response_header_mode=ProcessingMode.SKIP
    ),
)
# A P/D-path request served by the decode alone: its body is still checked, but it needs no
# response phase.
CHECK_BODY_ONLY_HEADERS = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=_STRIP_PREFILL_HEADER)
    ),
    mode_override=ProcessingMode(
        request_body_mode=ProcessingMode.BUFFERED, response_header_mode=ProcessingMode.SKIP
    ),
)
CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
CHECKED_REQUEST_BODY = pb.ProcessingResponse(
    request_body=pb.BodyResponse(), dynamic_metadata=_CHECKED
)


def checked_request_body(request_id: str | None, decode: str | None = None) -> Answer:
    """The client's body on unchanged, marked checked (and routed to `decode`, when given);
    with the request headers still held, `request_id` (when given) replaces x-request-id."""
    if request_id is None and decode is None:
        return CHECKED_REQUEST_BODY
    response = _marked(pb.ProcessingResponse(request_body=pb.BodyResponse()), decode)
    if request_id is None:
        return response
    mutation = response.request_body.response.header_mutation
    mutation.set_headers.append(_header("x-request-id", request_id.encode()))
    return response


CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())

# The answer that lets any message pass unchanged, by kind.
CONTINUE = {
    "request_headers": CONTINUE_REQUEST_HEADERS,
    "request_body": CONTINUE_REQUEST_BODY,
    "response_headers": CONTINUE_RESPONSE_HEADERS,
    "response_body": CONTINUE_RESPONSE_BODY,
    "request_trailers": CONTINUE_REQUEST_TRAILERS,
    "response_trailers": CONTINUE_RESPONSE_TRAILERS,
}


def immediate(reply: ErrorReply) -> pb.ProcessingResponse:
    """Answer the request in Envoy's place; Envoy cancels whatever is upstream."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=reply.status),
            headers=pb.HeaderMutation(
                set_headers=[
                    _header("content-type", b"application/json"),
                    _header("x-pdproc-error", reply.kind.value.encode()),
                ]
            ),
            body=reply.body(),
            details=f"pdproc_{reply.kind.value}",
        )
    )


def passed_through(status: int, answer: bytes, content_type: str | None) -> pb.ProcessingResponse:
    """A pod's refusal (NIXL: 400-451) with its own status, as an OpenAI-style JSON error
    (`errors.pod_refusal_body`: never the pod's body as it came)."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=status),
            headers=pb.HeaderMutation(
                set_headers=[
                    _header("content-type", b"application/json"),
                    _header("x-pdproc-error", b"prefill_failed"),
                ]
            ),
            body=pod_refusal_body(status, answer, content_type),
            details="pdproc_prefill_answer",
        )
    )


def body_response(
    body: bytes,
    *,
    content_length: bool,
    request_id: str | None = None,
    decode: str | None = None,
) -> Answer:
    """The rewritten body, routed to `decode` when given. With the request headers still
    held by Envoy, content-length must change with it (and `request_id`, when given,
    replaces x-request-id); in single-message mode they are gone upstream already and Envoy
    sends the body chunked."""
    head = _marked(pb.ProcessingResponse(), decode)
    if content_length:
        mutation = head.request_body.response.header_mutation
        mutation.set_headers.append(_header("content-length", str(len(body)).encode()))
        if request_id is not None:
            mutation.set_headers.append(_header("x-request-id", request_id.encode()))
    return body_answer(head, (body,))


# Stream this request's body (pdproc.streamed_body). Its content-length goes: the decode
# leg is sent chunked, its rewritten end making it longer. The body is marked checked only
# at its last chunk, so if pdproc fails mid-body (Envoy fails open and passes the rest on
# unseen), the kv guard, which holds a body that carries no mark, checks it whole.
STREAMED_HEADERS = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(remove_headers=[PREFILL_HEADER, "content-length"])
        )
    ),
    # Trailers too: a body followed by trailers (HTTP/2) has no chunk marked as its last.
    mode_override=ProcessingMode(
        request_body_mode=ProcessingMode.STREAMED,
        request_trailer_mode=ProcessingMode.SEND,
        response_header_mode=ProcessingMode.SEND,
    ),
)


def chunk_response(data: Buffer | None) -> Answer:
    """One streamed body chunk: on unchanged (None), or replaced by `data`."""
    if data is None:
        return CONTINUE_REQUEST_BODY
    if data:
        return body_answer(pb.ProcessingResponse(), (data,))
    response = pb.ProcessingResponse()
    response.request_body.response.body_mutation.clear_body = True
    return response


def last_chunk_response(data: Sequence[Buffer]) -> Answer:
    """The last chunk of a streamed body, replaced by `data` joined; the body is checked."""
    if any(data):
        return body_answer(pb.ProcessingResponse(dynamic_metadata=_CHECKED), data)
    response = pb.ProcessingResponse(dynamic_metadata=_CHECKED)
    response.request_body.response.body_mutation.clear_body = True
    return response


def ends_request(response: Answer) -> bool:
    """An immediate response: Envoy answers the client with it and closes the stream."""
    return not isinstance(response, Encoded) and response.HasField("immediate_response")


def answers_response_headers(response: Answer) -> bool:
    return not isinstance(response, Encoded) and response.HasField("response_headers")


def hold(seconds: float) -> pb.ProcessingResponse:
    """Give pdproc `seconds` (instead of the filter's message_timeout) to answer the message
    Envoy is waiting on. Envoy honours only the first such request per message."""
    response = pb.ProcessingResponse()
    whole = int(seconds)
    response.override_message_timeout.seconds = whole
    response.override_message_timeout.nanos = int((seconds - whole) * 1e9)
    return response


def _header(key: str, value: bytes) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value), append_action=_OVERWRITE)


def header_dict(headers: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's header list as a dict; repeated names are joined with a comma (RFC 9110)."""
    listed = headers.headers.headers
    # Names rarely repeat: one comprehension, and the joining loop only when one does.
    out = {h.key: h.raw_value.decode("latin-1") if h.raw_value else h.value for h in listed}
    if len(out) == len(listed):
        return out
    out = {}
    for h in listed:
        value = h.raw_value.decode("latin-1") if h.raw_value else h.value
        out[h.key] = f"{out[h.key]},{value}" if h.key in out else value
    return out


# Attributes that stand for a header of their own name in pdproc's view of the request.
_NAMED_ATTRIBUTES = (("request.method", ":method"), ("request.id", "x-request-id"))


def headers_from_attributes(request: pb.ProcessingRequest) -> dict[str, str] | None:
    """The headers pdproc needs, rebuilt from the attributes and metadata Envoy sent with
    the body message; None when there are none (the filter is in two-message mode)."""
    attributes = request.attributes.get(ATTRIBUTES_KEY)
    if attributes is None or "request.path" not in attributes.fields:
        return None
    fields = attributes.fields
    headers = {":path": fields["request.path"].string_value}
    for attribute, header in _NAMED_ATTRIBUTES:
        if attribute in fields:
            headers[header] = fields[attribute].string_value
    headers.update(_listed_headers(fields))
    prefill = _prefill_from_metadata(request)
    if prefill is not None:
        headers[PREFILL_HEADER] = prefill
    return headers


def _listed_headers(fields: Mapping[str, Any]) -> dict[str, str]:
    """Whatever headers the filter lists (`request.headers['<name>']`), not only the defaults;
    never a pseudo-header."""
    headers: dict[str, str] = {}
    for expression, value in fields.items():
        if expression.startswith(_HEADER_ATTRIBUTE) and expression.endswith("']"):
            name = expression[len(_HEADER_ATTRIBUTE) : -2].lower()
            if name and not name.startswith(":"):
                headers[name] = value.string_value
    return headers


def _prefill_from_metadata(request: pb.ProcessingRequest) -> str | None:
    """The endpoint picker's prefill target from the dynamic metadata: the target, "" when
    it says one is present but gives none, None when it says nothing."""
    metadata = request.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
    fields = metadata.fields if metadata is not None else {}
    if METADATA_PREFILL_KEY in fields:
        return str(fields[METADATA_PREFILL_KEY].string_value)
    if METADATA_PREFILL_PRESENT_KEY in fields:
        return ""
    return None


def status_of(headers: pb.HttpHeaders) -> str:
    """The `:status` of a response headers message ("" when absent)."""
    for h in headers.headers.headers:
        if h.key == ":status":
            return str(h.raw_value.decode("latin-1") if h.raw_value else h.value)
    return ""
