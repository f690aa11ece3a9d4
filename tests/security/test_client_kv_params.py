"""A client's own `kv_transfer_params` on a P/D path.

The params tell a decode pod where to pull KV from (`remote_bootstrap_addr`): a client that
sets them can aim the decode at any address. Earlier, pdproc replaced them when it
disaggregated, but a request without a prefill target (no header, no pool) or one arriving
while pdproc was draining passed through untouched, params and all. Now every P/D-path body
pdproc sees is checked: a client's `kv_transfer_params`, however spelled, is a 400, and the
decode receives nothing. (The Envoy-side cases, encoded paths and pdproc down, are tested
elsewhere.)
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from pdproc_sim.devstack import Stack, http_get, running_stack

from tests.stacks import records, served

from .conftest import CHAT_BYTES, SECONDS, SIM_ARGS, Pd, metric, send
from .pods import HostilePod

EVIL = b'{"do_remote_prefill":true,"remote_bootstrap_addr":"http://169.254.169.254:80"}'
HEAD = b'{"model":"m","messages":[{"role":"user","content":"Hello"}],"max_tokens":4,'
SPELLINGS = {
    "plain": HEAD + b'"kv_transfer_params":' + EVIL + b"}",
    "null": HEAD + b'"kv_transfer_params":null}',
    "one-escape": HEAD + b'"kv_transfer_param\\u0073":' + EVIL + b"}",
    "all-escaped": HEAD
    + b'"'
    + b"".join(b"\\u%04x" % c for c in b"kv_transfer_params")
    + b'":'
    + EVIL
    + b"}",
    "duplicate": HEAD + b'"kv_transfer_params":1,"kv_transfer_params":' + EVIL + b"}",
    "first-key": b'{"kv_transfer_params":' + EVIL + b',"model":"m","prompt":"x"}',
}
PD_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/inference/v1/generate"]


def assert_refused(status: int, kind: str | None, message: str) -> None:
    assert status == 400
    assert kind == "bad_request"
    assert "kv_transfer_params" in message


@pytest.mark.e2e
@pytest.mark.parametrize("body", list(SPELLINGS.values()), ids=list(SPELLINGS))
@pytest.mark.parametrize("target", [True, False], ids=["disaggregated", "no-target"])
def test_client_kv_transfer_params_get_400_through_envoy(
    fresh: Stack, body: bytes, target: bool
) -> None:
    refused = metric(fresh, "pdproc_requests_total", outcome="bad_request")
    response = send(fresh, body, str(fresh.sim.prefill) if target else None)
    assert_refused(
        response.status_code, response.headers.get("x-pdproc-error"), response.json()["message"]
    )
    # pdproc itself refused it (not only the kv guard behind it in Envoy).
    assert metric(fresh, "pdproc_requests_total", outcome="bad_request") == refused + 1
    assert records(fresh, "decode") == []
    assert records(fresh, "prefill") == []


@pytest.mark.e2e
@pytest.mark.parametrize("path", PD_PATHS)
def test_client_kv_transfer_params_get_400_on_every_pd_path(fresh: Stack, path: str) -> None:
    refused = metric(fresh, "pdproc_requests_total", outcome="bad_request")
    for prefill in (str(fresh.sim.prefill), None):
        response = send(fresh, SPELLINGS["plain"], prefill, path=path)
        assert response.status_code == 400, response.text
    assert metric(fresh, "pdproc_requests_total", outcome="bad_request") == refused + 2
    assert records(fresh, "decode") == []


async def test_client_kv_transfer_params_get_400_while_draining(
    pod: HostilePod, make_pdproc: Any
) -> None:
    """After `Server.stop()` begins (NOT_SERVING, still serving for its lame-duck time),
    new P/D requests are served by the decode alone, and their bodies are still checked."""
    pd: Pd = await make_pdproc(pod)
    async with pd.lame_duck(drain_timeout_s=5, within_s=SECONDS):
        for body in SPELLINGS.values():
            for prefill in (pod.address, None):
                outcome = await pd.play(body, prefill=prefill)
                assert outcome.error is not None
                assert_refused(outcome.status, outcome.error_kind, outcome.error["message"])
                assert outcome.decode_body is None
        normal = await pd.play(CHAT_BYTES, prefill=pod.address)
        assert normal.status == 200
        assert normal.decode_body == CHAT_BYTES  # decode-only: the client's bytes, no params
        assert pod.total_hits == 0  # no prefill, no bootstrap query while draining


@pytest.mark.e2e
@pytest.mark.slow
def test_client_kv_transfer_params_get_400_during_sigterm_shutdown_delay() -> None:
    """`pdproc serve` got SIGTERM and keeps serving for --shutdown-delay (NOT_SERVING):
    requests through Envoy still reach it, and a client's params are still refused."""
    args = ["--shutdown-delay", "5", "--drain-timeout", "2", "--prefill-timeout", "1"]
    with running_stack(SIM_ARGS, args) as stack:
        refused = metric(stack, "pdproc_requests_total", outcome="bad_request")
        stack.pdproc.popen.send_signal(signal.SIGTERM)
        ready = stack.metrics_addr.url() + "/readyz"
        deadline = time.monotonic() + SECONDS
        while http_get(ready)[0] != 503:
            assert time.monotonic() < deadline, "pdproc did not start draining"
            time.sleep(0.02)
        for prefill in (str(stack.sim.prefill), None):
            response = send(stack, SPELLINGS["plain"], prefill)
            assert_refused(
                response.status_code,
                response.headers.get("x-pdproc-error"),
                response.json()["message"],
            )
        # Refused by pdproc itself (the kv guard behind it would answer alike).
        assert metric(stack, "pdproc_requests_total", outcome="bad_request") == refused + 2
        normal = send(stack, CHAT_BYTES, str(stack.sim.prefill))
        assert normal.status_code == 200, normal.text
        (decode,) = served(stack, "decode", 1)  # only the normal one reached the decode
        assert "kv_transfer_params" not in decode["body"]  # served alone while draining
        assert stack.pdproc.popen.poll() is None  # all of it within the shutdown delay
        assert records(stack, "prefill") == []
