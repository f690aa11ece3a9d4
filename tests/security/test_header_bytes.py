"""Bad bytes in `x-prefiller-host-port`.

Earlier, the port was checked with `str.isdigit()`, which is true for a superscript two
(U+00B2) and other non-ASCII digits, while `int()` refuses them: `10.0.0.1:80` followed by
a superscript two became a 500 from pdproc's catch-all. Now targets are ASCII only, and
anything else is a 400.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from pdproc_sim.devstack import Stack

from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc.targets import AllowList
from tests.envoy_side import CHAT_PATH, single_message_body
from tests.stacks import records

from .conftest import CHAT_BYTES, SECONDS, Pd, metric, send
from .pods import HostilePod

# Header bytes as they arrive from Envoy: pdproc reads them as latin-1. The look-alike
# digits are written as escapes on purpose (they are the attack).
SUPERSCRIPT_TWO = "\u00b2"  # "2" superscript: str.isdigit() is true, int() refuses it
FULLWIDTH_80 = "\uff18\uff10"
ARABIC_INDIC_ZERO = "\u0660"
BOLD_80 = "\U0001d7d6\U0001d7ce"
FULLWIDTH_10 = "\uff11\uff10"
BAD_BYTES = {
    "superscript-latin1": b"10.0.0.1:80\xb2",  # one byte: latin-1 "80" + superscript two
    "superscript-utf8": f"10.0.0.1:80{SUPERSCRIPT_TWO}".encode(),
    "fullwidth-digits": f"10.0.0.1:{FULLWIDTH_80}".encode(),
    "arabic-indic-digit": f"10.0.0.1:8{ARABIC_INDIC_ZERO}".encode(),
    "fullwidth-host": f"{FULLWIDTH_10}.0.0.1:80".encode(),
    "nul": b"10.0.0.1:80\x00",
    "high-bytes": b"\xff\xfe:80",
}
# Every target allowed: only the parser stands between the header and a connection.
ALLOW_ALL = AllowList.parse(["*"])
# In single-message mode the value arrives as a (unicode) metadata string.
BAD_TEXT = [
    f"10.0.0.1:80{SUPERSCRIPT_TWO}",
    f"10.0.0.1:8{ARABIC_INDIC_ZERO}",
    f"10.0.0.1:{BOLD_80}",
    f"{FULLWIDTH_10}.0.0.1:80",
    "[::1%\uff12]:80",
]


@pytest.mark.parametrize("value", list(BAD_BYTES.values()), ids=list(BAD_BYTES))
async def test_non_ascii_target_bytes_get_400(
    pod: HostilePod, make_pdproc: Any, value: bytes
) -> None:
    pd: Pd = await make_pdproc(pod, prefill_allow=ALLOW_ALL)
    outcome = await pd.play(CHAT_BYTES, prefill=value)
    assert outcome.status == 400, outcome.error
    assert outcome.error_kind == "bad_request"
    assert outcome.decode_body is None
    assert pod.total_hits == 0


@pytest.mark.parametrize("value", BAD_TEXT)
async def test_non_ascii_target_text_gets_400_in_single_message_mode(
    pod: HostilePod, make_pdproc: Any, value: str
) -> None:
    pd: Pd = await make_pdproc(pod, prefill_allow=ALLOW_ALL)
    outcome = await pd.play(CHAT_BYTES, prefill=value, single_message=True)
    assert outcome.status == 400, outcome.error
    assert outcome.error_kind == "bad_request"
    assert pod.total_hits == 0


@pytest.mark.e2e
@pytest.mark.parametrize(
    "value",
    [BAD_BYTES["superscript-latin1"], BAD_BYTES["superscript-utf8"]],
    ids=["latin1", "utf8"],
)
def test_superscript_port_through_envoy_gets_400(fresh: Stack, value: bytes) -> None:
    response = send(fresh, CHAT_BYTES, value)
    # In single-message mode a value that is not UTF-8 reaches pdproc as a message protobuf
    # cannot parse (Envoy copies it into a string field): pdproc refuses that too.
    assert response.status_code == 400, response.text
    assert response.headers["x-pdproc-error"] == "bad_request"
    assert records(fresh, "decode") == []
    assert records(fresh, "prefill") == []


# -- single-message mode: header values that are not UTF-8 ---------------------------------

# Found by this suite: in single-message mode Envoy copies header values into proto3 string
# fields (request attributes, and the prefill header via header_to_metadata) without checking
# UTF-8; pdproc's gRPC server could not parse such a ProcessingRequest, the stream failed and
# Envoy failed open (the request bypassed pdproc). pdproc now answers it with a 400.
NOT_UTF8 = {
    "prefill-header": ("x-prefiller-host-port", b"10.0.0.1:80\xb2"),
    "authorization": ("authorization", b"Bearer \xb2"),
    "traceparent": ("traceparent", b"00-\xb2"),
}


def ext_proc_failures(stack: Stack) -> int:
    stats = stack.envoy.stats("http.ingress.ext_proc.")
    return int(stats.get("http.ingress.ext_proc.streams_failed", 0))


@pytest.mark.e2e
@pytest.mark.parametrize("header", list(NOT_UTF8.values()), ids=list(NOT_UTF8))
def test_header_bytes_that_are_not_utf8_are_answered_by_pdproc(
    fresh: Stack, header: tuple[str, bytes]
) -> None:
    name, value = header
    failures = ext_proc_failures(fresh)
    counted = metric(fresh, "pdproc_requests_total")
    prefill = value if name == "x-prefiller-host-port" else str(fresh.sim.prefill)
    headers = {} if name == "x-prefiller-host-port" else {name: value}
    response = send(fresh, CHAT_BYTES, prefill, headers=headers)
    assert response.status_code in (200, 400), response.text
    assert ext_proc_failures(fresh) == failures  # pdproc read the message and answered
    assert metric(fresh, "pdproc_requests_total") == counted + 1


async def test_single_message_with_non_utf8_attribute_gets_an_answer(
    pod: HostilePod, make_pdproc: Any
) -> None:
    """Minimal reproduction, without Envoy: the body message of single-message mode with a
    prefill header of `10.0.0.1:80` + byte 0xB2, as Envoy serialises it."""
    pd: Pd = await make_pdproc(pod)
    message = single_message_body(CHAT_BYTES, CHAT_PATH, "10.0.0.1:80Z", "req-1")
    raw = message.SerializeToString().replace(b"10.0.0.1:80Z", b"10.0.0.1:80\xb2")
    process = pd.channel.stream_stream(
        "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
        request_serializer=None,  # the bytes as they are
        response_deserializer=pb.ProcessingResponse.FromString,
    )
    call = process()
    await call.write(raw)
    async with asyncio.timeout(SECONDS):
        answer = await call.read()
    assert answer is not grpc.aio.EOF  # it used to fail the RPC (StatusCode.UNKNOWN)
    assert answer.immediate_response.status.code == 400
