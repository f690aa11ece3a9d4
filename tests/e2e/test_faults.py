"""Fault injection through a real Envoy: every failure is fast, clear and accounted for.

Time bounds here are generous upper limits that prove "seconds, not vLLM's 480 s", never
performance assertions.
"""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest
from pdproc_sim.devstack import Stack, free_port

from pdproc.outcomes import REQUEST_OUTCOMES
from tests.waiting import eventually

from .conftest import ext_proc_errors, forget_engine_ids

pytestmark = pytest.mark.e2e

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
FAST = 10.0  # seconds: the bound that separates "fails fast" from "waits for the KV timeout"
OUTCOMES = REQUEST_OUTCOMES


SIM_ARGS = ("--dp-ranks", "2", "--kv-timeout-s", "60", "--itl-ms", "5")
PDPROC_ARGS = ("--prefill-timeout", "2", "--bootstrap-timeout", "1", "--breaker-cooldown", "1",
               "--max-body-bytes", str(1024 * 1024), "--engine-refresh", "0")  # fmt: skip


def request(stack: Stack, prefill: str | None = None, **body: Any) -> tuple[httpx.Response, float]:
    headers = {"x-prefiller-host-port": prefill or str(stack.sim.prefill)}
    started = time.monotonic()
    response = httpx.post(
        stack.envoy.url + "/v1/chat/completions",
        json={**CHAT, **body},
        headers=headers,
        timeout=120,
    )
    return response, time.monotonic() - started


def envoy_details(stack: Stack) -> dict[str, int]:
    """Envoy's access log (JSON lines on its stdout): answers by status and details."""
    counts: dict[str, int] = {}
    for line in stack.envoy.process.log_path.read_text().splitlines():
        if line.startswith("{"):
            entry = orjson.loads(line)
            key = f"{entry['status']} {entry['flags']} {entry['details']}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def outcome_counts(stack: Stack) -> dict[str, float]:
    return {o: stack.metric("pdproc_requests_total", outcome=o) for o in OUTCOMES}


def test_prefill_500_is_a_fast_502(fresh: Stack) -> None:
    fresh.sim_post("prefill", "/sim/faults", {"prefill_status": 500})
    response, elapsed = request(fresh, stream=True)
    assert response.status_code == 502
    assert response.json()["type"] == "BadGateway"
    assert elapsed < FAST

    # pdproc aborts the request as soon as the prefill fails: the decode counted it cancelled
    # or, when Envoy reset its leg before it arrived (a loaded host), never got it at all.
    # Either way it served nothing.
    def decode_left_idle() -> bool:
        stats = fresh.sim_get("decode", "/sim/stats")
        idle = stats["in_flight"] == 0 and stats["completed"] == 0 and stats["kv_ok"] == 0
        return idle and (stats["cancelled"] >= 1 or not stats["requests"])

    eventually(decode_left_idle, what="the decode cancelled or never reached")


def test_prefill_hang_times_out_with_504_and_cancels_decode(fresh: Stack) -> None:
    fresh.sim_post("prefill", "/sim/faults", {"prefill_hang": True})
    response, elapsed = request(fresh, stream=True)
    assert response.status_code == 504
    body = response.json()
    assert body["type"] == "GatewayTimeout"
    assert "prefill timed out" in body["message"]
    assert elapsed < FAST  # --prefill-timeout 2 s, not the decode's 60 s KV timeout

    # pdproc's timeout also closes the prefill request, which makes the simulated prefill
    # drop its KV; the decode then either fails on its own or is reset by Envoy: both end
    # it now rather than after its 60 s KV timeout.
    def decode_ended() -> bool:
        stats = fresh.sim_get("decode", "/sim/stats")
        ended = stats["cancelled"] + sum(stats["kv_failures"].values())
        return stats["in_flight"] == 0 and ended >= 1

    eventually(decode_ended)


def test_refused_prefill_opens_the_breaker(fresh: Stack) -> None:
    # Its bootstrap server answers (same host) but nothing listens on the prefill port.
    dead = f"127.0.0.1:{free_port()}"
    before = fresh.metric("pdproc_prefills_total", outcome="connect_error")
    response, elapsed = request(fresh, prefill=dead)
    assert response.status_code == 502
    assert elapsed < FAST
    assert fresh.metric("pdproc_prefills_total", outcome="connect_error") == before + 1
    # The pod is known down: requests fail at once without trying it, but for one probe per
    # cooldown (a 502: it failed again). Sent together, they share one cooldown window.
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: request(fresh, prefill=dead)[0], range(3)))
    statuses = sorted(a.status_code for a in answers)
    assert statuses in ([503, 503, 503], [502, 503, 503]), statuses
    assert all(a.json()["type"] == "ServiceUnavailable" for a in answers if a.status_code == 503)
    probes = statuses.count(502)
    assert fresh.metric("pdproc_prefills_total", outcome="connect_error") == before + 1 + probes
    assert fresh.metric("pdproc_prefill_breaker_open", target=dead) == 1
    # After a cooldown a probe goes through (and fails again: still down).
    eventually(lambda: request(fresh, prefill=dead)[0].status_code == 502)
    assert fresh.metric("pdproc_prefills_total", outcome="connect_error") >= before + 2 + probes


def test_bootstrap_slow_gets_502_after_the_bootstrap_timeout(fresh: Stack) -> None:
    forget_engine_ids(fresh)
    fresh.sim_post("decode", "/sim/reset")
    fresh.sim_post("prefill", "/sim/faults", {"bootstrap": "slow", "bootstrap_delay_s": 5})
    response, elapsed = request(fresh)
    assert response.status_code == 502
    assert "timed out" in response.json()["message"]
    assert elapsed < FAST
    assert fresh.sim_get("decode", "/sim/requests")["requests"] == []


def test_a_restarted_pod_that_fails_a_prefill_is_queried_again(fresh: Stack) -> None:
    """The pod restarted (new engine ids) and its first prefill fails: that failure drops
    the cached map, so the next requests pair with the new ids. (Without a failure, the
    map's age bound does it: tests/e2e/test_engine_restart.py.)"""
    assert request(fresh)[0].status_code == 200  # engine map cached
    time.sleep(1.1)  # a map younger than a second survives failures (they come in bursts)
    fresh.sim_post("prefill", "/sim/restart")
    fresh.sim_post("prefill", "/sim/faults", {"prefill_status": 500})
    response, elapsed = request(fresh)
    assert response.status_code == 502
    assert elapsed < FAST  # the decode, told a gone engine, was aborted: no silent wait
    fresh.sim_post("prefill", "/sim/faults", {"clear": True})
    assert request(fresh)[0].status_code == 200
    new_ids = set(fresh.sim_get("prefill", "/sim/stats")["engine_ids"].values())
    last = fresh.sim_get("decode", "/sim/requests")["requests"][-1]
    assert last["body"]["kv_transfer_params"]["remote_engine_id"] in new_ids


def test_decode_down_gets_an_error_and_the_prefill_is_counted(fresh: Stack) -> None:
    fresh.sim_post("decode", "/sim/faults", {"status": 503})

    def ended() -> float:
        # The prefill ends `2xx`, or `cancelled` when the decode's error ended the request
        # before the prefill did (a loaded host): once the client has its answer, no decode
        # will read that KV.
        return sum(fresh.metric("pdproc_prefills_total", outcome=o) for o in ("2xx", "cancelled"))

    before = ended()
    response, elapsed = request(fresh)
    assert response.status_code == 503
    assert elapsed < FAST
    eventually(lambda: ended() == before + 1, what="the prefill counted")


def test_oversized_bodies_get_json_413(fresh: Stack) -> None:
    # Past pdproc's --max-body-bytes (1 MiB): pdproc answers.
    response, _ = request(fresh, prompt="x" * (2 * 1024 * 1024))
    assert response.status_code == 413
    assert response.json()["type"] == "RequestTooLargeError"
    # Past Envoy's buffer limit (16 MiB): Envoy answers, in the same JSON shape.
    response, _ = request(fresh, prompt="x" * (17 * 1024 * 1024))
    assert response.status_code == 413
    assert response.headers["content-type"] == "application/json"
    assert response.json()["type"] == "RequestTooLargeError"
    assert fresh.sim_get("decode", "/sim/requests")["requests"] == []


def test_soak_2000_requests_with_random_prefill_faults(fresh: Stack) -> None:
    """2,000 requests at concurrency 50, 5 % of prefills failing: every request is answered
    (200, or 502 for its failed prefill), none hangs, and pdproc's counters add up.

    A connection-level prefill failure opens the pod's breaker at once (a dead pod must cost
    one request, not one each), so if the loaded machine produces one, the requests of the
    next second get pdproc's 503 `prefill_unavailable`: allowed, but only if pdproc counted
    exactly those."""
    fresh.sim_post("prefill", "/sim/faults", {"prefill_fail_rate": 0.05})
    before = outcome_counts(fresh)
    rng = random.Random(1)

    async def run() -> list[tuple[int, str]]:
        gate = asyncio.Semaphore(50)
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:

            async def one(i: int) -> tuple[int, str]:
                async with gate:
                    response = await client.post(
                        fresh.envoy.url + "/v1/chat/completions",
                        json={**CHAT, "max_tokens": 2, "stream": rng.random() < 0.5},
                        headers={"x-prefiller-host-port": str(fresh.sim.prefill)},
                    )
                    await response.aread()
                    return response.status_code, response.headers.get("x-pdproc-error", "")

            async with asyncio.timeout(240):
                return await asyncio.gather(*(one(i) for i in range(2000)))

    answers = asyncio.run(run())
    kinds = {answer: answers.count(answer) for answer in set(answers)}
    expected = {(200, ""), (502, "prefill_failed"), (503, "prefill_unavailable")}
    assert set(kinds) <= expected, (kinds, envoy_details(fresh))
    ok = kinds.get((200, ""), 0)
    failed = kinds.get((502, "prefill_failed"), 0)
    unavailable = kinds.get((503, "prefill_unavailable"), 0)
    assert 20 <= failed <= 250  # about 5 %
    assert unavailable <= 500  # at most a breaker cooldown or two, never a stuck breaker

    def all_counted() -> dict[str, float] | None:
        counts = outcome_counts(fresh)
        return counts if sum(counts.values()) - sum(before.values()) == 2000 else None

    after = eventually(all_counted)
    delta = {k: after[k] - before[k] for k in OUTCOMES if after[k] != before[k]}
    expected_delta = {"pd": ok, "prefill_failed": failed, "prefill_unavailable": unavailable}
    assert delta == {k: v for k, v in expected_delta.items() if v}
    assert fresh.metric("pdproc_prefills_in_flight") == 0
    assert fresh.metric("pdproc_streams_active") == 0


def test_no_ext_proc_protocol_errors(stack: Stack) -> None:
    assert set(ext_proc_errors(stack).values()) == {0}
