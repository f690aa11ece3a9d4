"""Clients that announce a large body and do not send it.

On the streamed-body path (--stream-body-bytes) the byte budget used to reserve a body's
announced content-length at its headers: a handful of connections announcing 16 MiB, each
sending a few bytes and then holding, filled --max-inflight-bytes, and every other P/D
request got 503 `overloaded` for as long as they held. Now a streamed body counts only the
bytes that arrived: the lying clients hold a few bytes each, everyone else is served, and
when they hang up their requests are counted (as abandoned) and hold nothing.

Through a real Envoy, the simulated vLLM pair and `pdproc serve`, with raw sockets playing
the lying clients.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from pdproc_sim.devstack import Stack, running_stack

from .conftest import CHAT_BYTES, SECONDS, SIM_ARGS, metric, send

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024
BUDGET = 8 * MiB
ANNOUNCED = 8 * MiB  # one liar alone used to fill the whole budget
LIARS = 4
# What each liar sends of its body before it stops: the start of a chat request.
SENT = b'{"model":"m","messages":[{"role":"u'
LARGE = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "tok " * 150_000}]})


def until(check: Callable[[], Any]) -> Any:
    """Wait (bounded) for a state the stack reaches in the background."""
    deadline = time.monotonic() + SECONDS
    while not (found := check()):
        assert time.monotonic() < deadline, "state not reached"
        time.sleep(0.05)
    return found


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    args = ["--max-inflight-bytes", str(BUDGET), "--shutdown-delay", "0"]
    args += ["--stream-body-bytes", str(256 * 1024)]
    with running_stack(SIM_ARGS, args) as st:
        yield st


def lie(stack: Stack) -> socket.socket:
    """A client that announces ANNOUNCED bytes of body, sends SENT and holds."""
    sock = socket.create_connection((stack.envoy.listen.host, stack.envoy.listen.port))
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
        f"content-type: application/json\r\nx-prefiller-host-port: {stack.sim.prefill}\r\n"
        f"content-length: {ANNOUNCED}\r\n\r\n"
    )
    sock.sendall(head.encode() + SENT)
    return sock


def test_clients_announcing_large_bodies_and_holding_harm_only_themselves(stack: Stack) -> None:
    target = str(stack.sim.prefill)
    liars = [lie(stack) for _ in range(LIARS)]
    try:
        # pdproc saw each liar's headers (streamed) and the bytes it sent, nothing more.
        until(lambda: metric(stack, "pdproc_streamed_request_bodies_total") == LIARS)
        until(lambda: metric(stack, "pdproc_request_body_bytes_in_flight") == LIARS * len(SENT))
        # Everyone else is served P/D: small buffered bodies and a large streamed one.
        for _ in range(3):
            response = send(stack, CHAT_BYTES, target)
            assert response.status_code == 200, response.text
        response = send(stack, LARGE, target)
        assert response.status_code == 200, response.text
        assert metric(stack, "pdproc_streamed_request_bodies_total") == LIARS + 1
        assert metric(stack, "pdproc_requests_total", outcome="pd") == 4
        assert metric(stack, "pdproc_requests_total", outcome="overloaded") == 0
        # The liars still hold only what they sent.
        assert metric(stack, "pdproc_request_body_bytes_in_flight") == LIARS * len(SENT)
    finally:
        for sock in liars:
            sock.close()
    # Hanging up frees what they held, and each is counted once, not as served.
    until(lambda: metric(stack, "pdproc_request_body_bytes_in_flight") == 0)
    until(lambda: metric(stack, "pdproc_streams_active") == 0)
    until(lambda: metric(stack, "pdproc_requests_total", outcome="abandoned") == LIARS)
    assert metric(stack, "pdproc_requests_total", outcome="pd") == 4
    assert metric(stack, "pdproc_prefills_total") == 4  # the liars never reached a prefill


def test_the_budget_still_bounds_bytes_that_really_arrived(stack: Stack) -> None:
    """A client that does send its bytes holds them: past the budget, others get 503."""
    sock = socket.create_connection((stack.envoy.listen.host, stack.envoy.listen.port))
    body = b'{"model":"m","prompt":"' + b"x" * (BUDGET + MiB)
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        f"x-prefiller-host-port: {stack.sim.prefill}\r\ncontent-length: {len(body) + 2}\r\n\r\n"
    )
    refused_before = metric(stack, "pdproc_requests_total", outcome="overloaded")
    try:
        sock.sendall(head.encode() + body)  # all but the closing '"}'
        until(lambda: metric(stack, "pdproc_request_body_bytes_in_flight") >= BUDGET)
        response = send(stack, LARGE, str(stack.sim.prefill))
        assert response.status_code == 503
        assert response.headers["x-pdproc-error"] == "overloaded"
        assert metric(stack, "pdproc_requests_total", outcome="overloaded") == refused_before + 1
    finally:
        sock.close()
    until(lambda: metric(stack, "pdproc_request_body_bytes_in_flight") == 0)
    assert send(stack, CHAT_BYTES, str(stack.sim.prefill)).status_code == 200
