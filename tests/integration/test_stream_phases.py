"""A stream that ends at any phase is counted exactly once.

Envoy ends an ext_proc stream early when the client hangs up (a reset) or when it has no
more to send (a half-close). Each kind of request (P/D buffered, P/D streamed, decode-only)
is ended after each message it can be waiting at, both ways, and must show exactly one
outcome in pdproc_requests_total, the expected one, also after its prefill has ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdproc.outcomes import REQUEST_OUTCOMES
from tests.envoy_side import CHAT, body_msg, headers_msg, recv, response_headers_msg
from tests.waiting import eventually_async

from .harness import Harness

KiB = 1024
LARGE = orjson.dumps({**CHAT, "messages": [{"role": "user", "content": "p" * (8 * KiB)}]})

# (kind, where the stream ends) -> the one outcome it is counted as.
CASES = {
    ("pd", "after_headers"): "abandoned",
    ("pd", "after_body"): "cancelled",  # its prefill was still running: cancelled
    ("pd", "held"): "cancelled",  # the decode answered, pdproc held it for the prefill
    ("pd", "after_response"): "pd",
    ("streamed", "after_headers"): "abandoned",
    ("streamed", "mid_body"): "abandoned",
    ("streamed", "after_body"): "cancelled",
    ("streamed", "held"): "cancelled",
    ("streamed", "after_response"): "pd",
    ("decode_only", "after_headers"): "abandoned",
    ("decode_only", "after_body"): "passthrough",
    ("decode_only", "after_response"): "passthrough",
}


def all_outcomes(h: Harness) -> dict[str, float]:
    page = h.server.metrics.exposition().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "pdproc_requests_total" and sample.value:
                outcome = sample.labels["outcome"]
                found[outcome] = found.get(outcome, 0) + sample.value
    return found


async def play(h: Harness, kind: str, end_at: str) -> Any:
    """Drive one request up to `end_at`; returns the open call."""
    extra = {} if kind == "decode_only" else dict(h.target)
    body = LARGE if kind == "streamed" else orjson.dumps(CHAT)
    if kind == "streamed":
        extra["content-length"] = str(len(body))
    call = h.open()
    await call.write(headers_msg(extra=extra))
    await recv(call)
    if end_at == "after_headers":
        return call
    if kind == "streamed":
        await call.write(body_msg(body[: 4 * KiB], end_of_stream=False))
        await recv(call)
        if end_at == "mid_body":
            return call
        body = body[4 * KiB :]
    await call.write(body_msg(body))
    await recv(call)
    if end_at == "after_body":
        return call
    await call.write(response_headers_msg("200"))
    if end_at == "after_response":
        assert (await recv(call)).WhichOneof("response") == "response_headers"
    return call  # "held": the answer waits for the hanging prefill


@pytest.mark.parametrize("ending", ["reset", "half_close"])
@pytest.mark.parametrize(("kind", "end_at"), list(CASES))
async def test_a_stream_ended_at_any_phase_is_counted_exactly_once(
    make_harness: Callable[..., Any], kind: str, end_at: str, ending: str
) -> None:
    h: Harness = await make_harness(stream_body_bytes=4 * KiB)
    service = h.server.service
    assert service is not None
    # A prefill that is still running when the stream ends (except where the decode's
    # answer must get through first).
    await h.faults(prefill_hang=end_at != "after_response")
    try:
        call = await play(h, kind, end_at)
        if ending == "reset":
            call.cancel()
        else:
            await call.done_writing()
        await eventually_async(lambda: h.sample("pdproc_streams_active") == 0)
    finally:
        await h.faults(prefill_hang=False)
    await eventually_async(lambda: h.sample("pdproc_prefills_in_flight") == 0)
    expected = CASES[(kind, end_at)]
    assert all_outcomes(h) == {expected: 1}
    assert expected in REQUEST_OUTCOMES
    assert h.sample("pdproc_request_body_bytes_in_flight") == 0
    assert len(service.breakers) == 0  # a client leaving is never the pod's fault
