"""HTTP/2 framing a client chooses: a streamed body cut into tiny DATA frames.

A body at or above --stream-body-bytes streams through pdproc, one ext_proc message per
chunk Envoy hands on, and Envoy's HTTP/2 codec hands on one chunk per DATA frame. A 300 KiB
body in 8-byte frames was ~37,000 messages on Envoy's one connection to pdproc; pdproc read
them slower than they came, Envoy's flood protection (`http2.outbound_flood`) closed that
connection, and every other request on it failed (counted `abandoned`/`cancelled`). Now
Envoy queues at most 64 KiB for pdproc before it pauses the senders (the pdproc cluster's
`per_connection_buffer_limit_bytes`), which also coalesces the frames it holds meanwhile,
and pdproc refuses a streamed body that comes in more chunks than its bytes allow
(pdproc.streamed_body.max_chunks) with a 400 counted `bad_request`.

The client is `h2` over a plain socket, so the test, not a library, picks the frames.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import orjson
import pytest
from pdproc_sim.devstack import Stack, running_stack

from tests.envoy_side import CHAT_PATH
from tests.stacks import records

from .conftest import CHAT_BYTES, PDPROC_ARGS, SIM_ARGS, metric, send
from .h2client import h2_post

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

VICTIMS = 4
# Each victim's requests are bounded; they go on while the attacker sends.
VICTIM_REQUESTS = 300
BODY_BYTES = 300 * 1024  # above the default --stream-body-bytes (256 KiB): streamed


def big_body(size: int = BODY_BYTES) -> bytes:
    head = b'{"model":"m","messages":[{"role":"user","content":"'
    tail = b'"}]}'
    return head + b"a" * (size - len(head) - len(tail)) + tail


@pytest.fixture(scope="module")
def h2_stack() -> Iterator[Stack]:
    """Two-message mode (the one that streams bodies), the simulated prefill as pool."""
    with running_stack(SIM_ARGS, PDPROC_ARGS, pool=True) as st:
        yield st


def flood_stats(stack: Stack) -> dict[str, int]:
    stats = stack.envoy.stats()
    names = (
        "cluster.pdproc.http2.outbound_flood",
        "cluster.pdproc.upstream_cx_destroy_local_with_active_rq",
        "http.ingress.ext_proc.streams_failed",
    )
    return {name: stats.get(name, 0) for name in names}


def attack_with_victims(stack: Stack, frame_bytes: int) -> tuple[int, bytes, Counter[int]]:
    """One h2c client sends the big body in `frame_bytes` DATA frames while VICTIMS other
    clients send ordinary P/D requests; the attacker's status and body, the victims'
    statuses."""
    statuses: Counter[int] = Counter()
    done = threading.Event()
    started = threading.Barrier(VICTIMS + 1)

    def victim() -> None:
        started.wait()
        for _ in range(VICTIM_REQUESTS):
            statuses[send(stack, CHAT_BYTES).status_code] += 1
            if done.is_set():
                return

    threads = [threading.Thread(target=victim) for _ in range(VICTIMS)]
    for thread in threads:
        thread.start()
    try:
        started.wait()
        host, port = stack.envoy.listen.host, stack.envoy.listen.port
        answer = h2_post(host, port, CHAT_PATH, big_body(), frame_bytes=frame_bytes)
    finally:
        done.set()
        for thread in threads:
            thread.join()
    return answer.status, answer.body, statuses


@pytest.mark.parametrize("frame_bytes", [8, 64])
def test_tiny_data_frames_harm_only_their_sender(h2_stack: Stack, frame_bytes: int) -> None:
    before = flood_stats(h2_stack)
    pd = metric(h2_stack, "pdproc_requests_total", outcome="pd")
    refused = metric(h2_stack, "pdproc_requests_total", outcome="bad_request")
    lost = sum(
        metric(h2_stack, "pdproc_requests_total", outcome=outcome)
        for outcome in ("abandoned", "cancelled")
    )
    status, body, victims = attack_with_victims(h2_stack, frame_bytes)
    # Every other user was served, disaggregated, and counted so.
    assert set(victims) == {200}, victims
    served = sum(victims.values())
    attacker_pd = 1 if status == 200 else 0
    assert metric(h2_stack, "pdproc_requests_total", outcome="pd") == pd + served + attacker_pd
    assert (
        sum(
            metric(h2_stack, "pdproc_requests_total", outcome=outcome)
            for outcome in ("abandoned", "cancelled")
        )
        == lost
    )
    # Envoy's connection to pdproc survived: no flood, no request lost with it.
    assert flood_stats(h2_stack) == before
    # The attacker: a clear 400 counted once (or, coalesced enough, simply served).
    if status != 200:
        assert status == 400, (status, body[:300])
        assert b"too many pieces" in body
        assert orjson.loads(body)["type"] == "BadRequestError"
        assert metric(h2_stack, "pdproc_requests_total", outcome="bad_request") == refused + 1


def test_ordinary_data_frames_stream_the_body_through(h2_stack: Stack) -> None:
    streamed = metric(h2_stack, "pdproc_streamed_request_bodies_total")
    pd = metric(h2_stack, "pdproc_requests_total", outcome="pd")
    host, port = h2_stack.envoy.listen.host, h2_stack.envoy.listen.port
    answer = h2_post(host, port, CHAT_PATH, big_body(), frame_bytes=16384)
    assert answer.status == 200, answer.body[:300]
    assert metric(h2_stack, "pdproc_streamed_request_bodies_total") == streamed + 1
    assert metric(h2_stack, "pdproc_requests_total", outcome="pd") == pd + 1


# -- request trailers ----------------------------------------------------------------------

SMALL_BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3}'
OUTCOMES = ("bad_request", "too_large", "pd", "passthrough", "abandoned", "cancelled")


@pytest.fixture(scope="module", params=["two-message", "single-message"])
def mode_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    options = {"single_message": request.param == "single-message"}
    with running_stack(SIM_ARGS, PDPROC_ARGS, envoy_options=options, pool=True) as st:
        yield st


def outcome_counts(stack: Stack) -> dict[str, float]:
    return {o: metric(stack, "pdproc_requests_total", outcome=o) for o in OUTCOMES}


@pytest.mark.parametrize(
    "body", [SMALL_BODY, b"", big_body()], ids=["small-body", "no-body", "streamed-body"]
)
def test_request_trailers_on_a_pd_path_are_a_400_counted_once(
    mode_stack: Stack, body: bytes
) -> None:
    """Before: a small body with trailers was a 413 counted `too_large` (Envoy sends a body
    followed by trailers without end_of_stream), and trailers with no body reached the
    decode counted under no outcome. Now each is a 400, counted `bad_request` once, and
    the decode gets nothing."""
    mode_stack.sim_post("decode", "/sim/reset")
    before = outcome_counts(mode_stack)
    host, port = mode_stack.envoy.listen.host, mode_stack.envoy.listen.port
    answer = h2_post(host, port, CHAT_PATH, body, trailers={"x-trailer": "1"})
    assert answer.status == 400, answer.body[:300]
    assert b"trailers are not supported" in answer.body
    after = outcome_counts(mode_stack)
    assert {o: after[o] - before[o] for o in OUTCOMES} == {
        o: 1.0 if o == "bad_request" else 0.0 for o in OUTCOMES
    }
    assert records(mode_stack, "decode") == []
