"""Issue 19, item 6: pdproc's own resource exhaustion is never held against a pod.

A prefill connect that fails because pdproc is out of file descriptors ("Too many open
files") used to count as the pod's `connect_error` and open healthy pods' breakers. The
test makes it really happen: with one prefill holding the pooled connection, the soft
RLIMIT_NOFILE of this process is lowered to the next descriptor's number, so the next
prefill's socket() fails with EMFILE. That request gets 503 `overloaded`, its prefill counts
`exhausted`, and the pod's breaker (opening at the first failure here) stays closed.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from typing import Any

import orjson

from pdproc.targets import parse_host_port

from .harness import Harness, eventually
from .messages import CHAT, body_msg, recv, response_headers_msg


def lowest_free_descriptor() -> int:
    """The number the next open() or socket() would get: with the soft limit at it, that
    call fails with EMFILE."""
    taken = {int(name) for name in os.listdir("/proc/self/fd")}
    taken.discard(max(taken))  # listdir's own descriptor, closed again by now
    return min(set(range(len(taken) + 1)) - taken)


async def test_pdproc_out_of_descriptors_is_not_the_pods_fault(
    make_harness: Callable[..., Any],
) -> None:
    h: Harness = await make_harness(breaker_failures=1)
    service = h.server.service
    assert service is not None
    # A whole request first: the engine map is cached, connections are pooled.
    call = await h.past_headers()
    await call.write(body_msg(CHAT))
    await recv(call)
    await call.write(response_headers_msg("200"))
    await recv(call)
    await h.faults(prefill_hang=True)
    held = await h.past_headers()
    await held.write(body_msg(CHAT))
    await recv(held)
    await eventually(lambda: service.launcher.total_in_flight == 1)
    starved = await h.past_headers()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free_descriptor(), hard))
    try:
        await starved.write(body_msg(CHAT))
        await recv(starved)  # the body's answer, then the abort
        abort = await recv(starved)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert abort.immediate_response.status.code == 503
    assert orjson.loads(abort.immediate_response.body)["type"] == "ServiceUnavailable"
    assert h.sample("pdproc_prefills_total", outcome="exhausted") == 1
    assert h.sample("pdproc_prefills_total", outcome="connect_error") == 0
    assert h.sample("pdproc_requests_total", outcome="overloaded") == 1
    assert h.sample("pdproc_prefill_breaker_open") == 0
    assert service.breakers.allow(parse_host_port(h.prefill.address))
    await h.faults(prefill_hang=False)
    held.cancel()
    starved.cancel()
