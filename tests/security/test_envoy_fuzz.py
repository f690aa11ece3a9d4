"""Anything a client can put in a body or header, through the real stack: a small fuzz (tens of
examples per Envoy mode) of bodies and `x-prefiller-host-port` values sent by a client to Envoy,
with pdproc and the simulated vLLM pair behind it. Whatever a client sends: never a 5xx, Envoy's
ext_proc stream never fails, a refused body reaches neither pod, and a carried one reaches both
legs exactly."""

from __future__ import annotations

import itertools
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from pdproc_sim.devstack import Stack

from .conftest import (
    CHAT_BYTES,
    SECONDS,
    has_series,
    metric,
    raw_records,
    send,
)
from .strategies import PRIMED, as_header, client_bodies, expected, header_values

pytestmark = pytest.mark.e2e

FUZZ = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
TAG = "x-security-example"
EXT_PROC_ERRORS = ("streams_failed", "spurious_msgs_received", "rejected_header_mutations")
_tags = itertools.count(1)


def ext_proc_errors(stack: Stack) -> dict[str, int]:
    stats = stack.envoy.stats("http.ingress.ext_proc.")
    return {name: stats.get(f"http.ingress.ext_proc.{name}", 0) for name in EXT_PROC_ERRORS}


def tagged(stack: Stack, role: str, tag: str) -> list[dict[str, Any]]:
    return [r for r in raw_records(stack, role) if r["headers"].get(TAG) == tag]


def decode_of(stack: Stack, tag: str) -> dict[str, Any]:
    """The decode's record of this example, once it has answered (bounded wait)."""
    deadline = time.monotonic() + SECONDS
    while True:
        found = [r for r in tagged(stack, "decode", tag) if r["status"] is not None]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"the decode never served {tag}"
        time.sleep(0.02)


def assert_refused_before_the_decode(
    stack: Stack, response: httpx.Response, tag: str, refused: float
) -> None:
    assert response.status_code == 400, response.text
    assert response.headers["x-pdproc-error"] == "bad_request"
    assert metric(stack, "pdproc_requests_total", outcome="bad_request") == refused + 1
    assert tagged(stack, "decode", tag) == []


def assert_carried_to_both_legs(
    stack: Stack, response: httpx.Response, tag: str, client: dict[str, Any]
) -> None:
    """The decode got the client's object exactly plus the gateway's params; the prefill
    paired with it got the client's values exactly (but for what priming changes)."""
    assert response.status_code == 200, response.text
    decode = decode_of(stack, tag)["body"]
    params = decode["kv_transfer_params"]
    assert decode == {**client, "kv_transfer_params": params}
    (prefill,) = [
        r["body"]
        for r in raw_records(stack, "prefill")
        if r["body"]["kv_transfer_params"]["transfer_id"] == params["transfer_id"]
    ]
    for key, value in client.items():
        if key not in PRIMED:
            assert prefill[key] == value, key


def test_fuzzed_bodies_through_envoy(fresh: Stack) -> None:
    errors = ext_proc_errors(fresh)
    target = str(fresh.sim.prefill)

    @FUZZ
    @given(body=client_bodies(primed_fields=False))
    @example(body=b'{"model":"m","max_tokens":4,"x":' + b"[" * 300 + b"]" * 300 + b"}")
    @example(body=b'{"model":"m","max_tokens":4,"kv_transfer_param\\u0073":{}}')
    @example(body=b'{"model":"m","max_tokens":4,"seed":18446744073709551615}')
    def check(body: bytes) -> None:
        verdict, client = expected(body)
        event(verdict)
        tag = f"fuzz-{next(_tags)}"
        refused = metric(fresh, "pdproc_requests_total", outcome="bad_request")
        response = send(fresh, body, target, headers={TAG: tag})
        assert response.status_code < 500, response.text
        if verdict == "400":
            assert_refused_before_the_decode(fresh, response, tag, refused)
        elif verdict == "pd":
            assert client is not None
            assert_carried_to_both_legs(fresh, response, tag, client)

    check()
    assert ext_proc_errors(fresh) == errors


def test_fuzzed_prefiller_headers_through_envoy(fresh: Stack) -> None:
    errors = ext_proc_errors(fresh)
    pod = fresh.sim.prefill

    @FUZZ
    @given(value=header_values(pod.port, longest=20_000, printable=True))
    @example(value="10.0.0.1:80\u00b2")
    @example(value=f"http://{pod}/,10.0.0.1:1")
    def check(value: str) -> None:
        tag = f"fuzz-{next(_tags)}"
        for encoding in ("latin-1", "utf-8"):
            # HTTP drops blanks around a value (and an HTTP client will not send them).
            header = as_header(value.strip(" \t"), encoding)
            assert isinstance(header, bytes)
            before = ext_proc_errors(fresh)
            response = send(fresh, CHAT_BYTES, header, headers={TAG: tag + encoding})
            assert ext_proc_errors(fresh) == before, (header[:80], response.status_code)
            # 431: Envoy's own limit on header size; everything else is pdproc's or the
            # decode's answer.
            assert response.status_code in (200, 400, 403, 431), response.text
            if response.status_code == 200:
                decode = decode_of(fresh, tag + encoding)["body"]
                if "kv_transfer_params" in decode:
                    bootstrap = decode["kv_transfer_params"]["remote_bootstrap_addr"]
                    assert bootstrap == fresh.sim.bootstrap.url()
            else:
                assert tagged(fresh, "decode", tag + encoding) == []

    check()
    assert ext_proc_errors(fresh) == errors
    assert metric(fresh, "pdproc_requests_total", outcome="internal_error") == 0
    assert not has_series(fresh, "pdproc_prefill_breaker_open")
