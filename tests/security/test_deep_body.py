"""P/D switched off for everyone by a deep body.

Earlier, the body `{"model":"m","x":[[[...300...]]]}` parsed, the decode body was spliced,
and the prefill body was only built inside the detached prefill task, where orjson refused
the nesting: the client got a 502, the failure was held against the prefill pod (its
breaker opened after five) and its engine ids were dropped, so five requests switched P/D off
for every user of that pod. With the same body plus a client `kv_transfer_params` the decode
body was re-serialised on the request path and the client got a 500.

Now both legs are built before pdproc answers: the client gets a 400 and nothing else moves.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pdproc_sim.devstack import Stack

from tests.stacks import records, served

from .conftest import CHAT_BYTES, Pd, deep_body, has_series, metric, send
from .pods import HostilePod

KV = b'"kv_transfer_params":{"do_remote_prefill":true,"remote_bootstrap_addr":"http://10.9.9.9"},'


def assert_bad_request(status: int, kind: str | None, error: dict[str, Any] | None) -> None:
    assert status == 400
    assert kind == "bad_request"
    assert error is not None
    assert error["type"] == "BadRequestError"


@pytest.mark.e2e
def test_five_deep_bodies_get_400_and_leave_pd_on_for_everyone(fresh: Stack) -> None:
    target = str(fresh.sim.prefill)
    invalidations = metric(fresh, "pdproc_engine_cache_events_total", event="invalidation")
    prefills = metric(fresh, "pdproc_prefills_total")
    refused = metric(fresh, "pdproc_requests_total", outcome="bad_request")
    for _ in range(5):
        response = send(fresh, deep_body(300), target)
        assert_bad_request(
            response.status_code, response.headers.get("x-pdproc-error"), response.json()
        )
    assert metric(fresh, "pdproc_requests_total", outcome="bad_request") == refused + 5
    assert not has_series(fresh, "pdproc_prefill_breaker_open")
    assert metric(fresh, "pdproc_engine_cache_events_total", event="invalidation") == invalidations
    assert metric(fresh, "pdproc_prefills_total") == prefills  # no prefill was even sent
    assert records(fresh, "prefill") == []
    assert records(fresh, "decode") == []

    # Another user, right after: still disaggregated.
    response = send(fresh, CHAT_BYTES, target)
    assert response.status_code == 200, response.text
    (prefill,) = served(fresh, "prefill", 1)
    (decode,) = served(fresh, "decode", 1)
    decode_kv = decode["body"]["kv_transfer_params"]
    assert decode_kv["do_remote_prefill"] is True
    assert decode_kv["transfer_id"] == prefill["body"]["kv_transfer_params"]["transfer_id"]
    assert not has_series(fresh, "pdproc_prefill_breaker_open")


@pytest.mark.e2e
def test_deep_body_with_client_kv_transfer_params_gets_400_not_500(fresh: Stack) -> None:
    body = deep_body(300).replace(b'{"model":"m",', b'{"model":"m",' + KV, 1)
    assert orjson.loads(body)["kv_transfer_params"]["do_remote_prefill"] is True
    refused = metric(fresh, "pdproc_requests_total", outcome="bad_request")
    response = send(fresh, body, str(fresh.sim.prefill))
    assert_bad_request(
        response.status_code, response.headers.get("x-pdproc-error"), response.json()
    )
    assert "kv_transfer_params" in response.json()["message"]
    # pdproc refused it itself (the kv guard behind it in Envoy would answer alike).
    assert metric(fresh, "pdproc_requests_total", outcome="bad_request") == refused + 1
    assert records(fresh, "decode") == []
    assert records(fresh, "prefill") == []


async def test_deep_bodies_touch_no_breaker_no_cache_no_pod(
    pod: HostilePod, make_pdproc: Any
) -> None:
    """The same attack on a pdproc in process: its breaker table stays empty."""
    pd: Pd = await make_pdproc(pod)
    for depth in (254, 300, 1000, 1025, 5000):
        outcome = await pd.play(deep_body(depth), prefill=pod.address)
        assert_bad_request(outcome.status, outcome.error_kind, outcome.error)
        assert outcome.decode_body is None
    assert len(pd.service.breakers) == 0
    assert pd.sample("pdproc_engine_cache_events_total", event="invalidation") == 0
    assert pod.hits["prefill"] == 0
    normal = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert normal.disaggregated
    assert normal.kv_params is not None
    assert normal.kv_params["remote_engine_id"] == "e0"
    assert pod.hits["prefill"] == 1
