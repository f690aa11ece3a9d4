"""NIXL v2 and SGLang through the real Envoy: pdproc (`--kv-connector`) against the simulated
pair speaking the same connector. Mooncake has its own suites (test_pd_through_envoy.py,
test_faults.py); here each connector's protocol on both legs, streaming and not, chat,
completions and responses, prefill failure, the client hanging up and a 2 MiB prompt."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from pdproc_sim.devstack import Stack, running_stack

from tests.stacks import records, served
from tests.waiting import eventually

from .conftest import ext_proc_errors

pytestmark = pytest.mark.e2e

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "m", "prompt": "Hello", "max_tokens": 8},
    "/v1/responses": {"model": "m", "input": "Hello", "max_output_tokens": 8},
}


@pytest.fixture(scope="module", params=["nixlv2", "sglang"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    sim = ["--itl-ms", "5", "--prefill-delay-ms", "10", "--kv-timeout-s", "60"]
    with running_stack(sim, kv_connector=request.param) as st:
        yield st


def connector(stack: Stack) -> str:
    return str(stack.sim_get("decode", "/sim/stats")["kv_connector"])


def post(stack: Stack, path: str, body: dict[str, Any], timeout_s: float = 60) -> httpx.Response:
    headers = {"x-prefiller-host-port": str(stack.sim.prefill)}
    return httpx.post(stack.envoy.url + path, json=body, headers=headers, timeout=timeout_s)


def assert_protocol(stack: Stack, prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    """Each leg carries what the connector's servers need, and they match."""
    if connector(stack) == "nixlv2":
        assert_nixl_legs(prefill, decode)
    else:
        assert_sglang_legs(stack, prefill, decode)
    assert decode["kv"]["reason"] is None


def assert_nixl_legs(prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    kv = prefill["body"]["kv_transfer_params"]
    assert kv == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert prefill["body"]["stream"] is False
    assert "stream_options" not in prefill["body"]
    # Both legs carry the same request id; the decode got the prefill's answer params.
    assert prefill["headers"]["x-request-id"] == decode["headers"]["x-request-id"]
    decode_kv = decode["body"]["kv_transfer_params"]
    assert decode_kv["do_remote_prefill"] is True
    assert decode_kv["remote_engine_id"]
    assert decode_kv["remote_block_ids"]


def assert_sglang_legs(stack: Stack, prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    for field in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        assert prefill["body"][field] == decode["body"][field]
    assert prefill["body"]["bootstrap_host"] == stack.sim.prefill.host
    assert prefill["body"]["bootstrap_port"] == stack.sim.bootstrap.port
    assert 0 <= decode["body"]["bootstrap_room"] < 2**63
    assert "kv_transfer_params" not in decode["body"]


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("stream", [False, True])
def test_both_legs_speak_the_connector(fresh: Stack, path: str, stream: bool) -> None:
    body = {**BODIES[path], "stream": stream}
    response = post(fresh, path, body)
    assert response.status_code == 200, response.text
    if stream:
        assert "data:" in response.text
        assert '"error"' not in response.text
    (prefill,) = served(fresh, "prefill", 1)
    (decode,) = served(fresh, "decode", 1)
    assert_protocol(fresh, prefill, decode)
    if connector(fresh) == "nixlv2":
        # The decode gets the client's own stream and token limits back.
        assert decode["body"].get("stream") is stream
        for name, value in BODIES[path].items():
            if name.startswith("max_"):
                assert decode["body"][name] == value
                assert prefill["body"][name] == 1
    name = connector(fresh)
    eventually(lambda: fresh.metric("pdproc_requests_total", outcome="pd", connector=name) >= 1)
    assert ext_proc_errors(fresh)["streams_failed"] == 0


def test_two_mib_prompt(fresh: Stack) -> None:
    body = {"model": "m", "prompt": "tok " * (512 * 1024), "max_tokens": 4}
    response = post(fresh, "/v1/completions", body)
    assert response.status_code == 200, response.text[:300]
    (decode,) = served(fresh, "decode", 1)
    assert decode["kv"]["reason"] is None


def test_client_params_of_the_connector_are_refused(fresh: Stack) -> None:
    own = {"bootstrap_room": 1} if connector(fresh) == "sglang" else {"kv_transfer_params": {}}
    response = post(fresh, "/v1/chat/completions", {**CHAT, **own})
    assert response.status_code == 400
    assert records(fresh, "decode") == []


def test_prefill_4xx(fresh: Stack) -> None:
    """NIXL: the prefill's own 4xx goes back as it is. SGLang: a clean 502, decode ended."""
    fresh.sim_post("prefill", "/sim/faults", {"prefill_status": 400})
    response = post(fresh, "/v1/chat/completions", CHAT)
    if connector(fresh) == "nixlv2":
        assert response.status_code == 400
        assert response.headers["x-pdproc-error"] == "prefill_failed"
        assert records(fresh, "decode") == []
        assert "simulated prefill failure" in response.text  # the prefill's own error body
    else:
        assert response.status_code == 502
        assert response.json()["type"] == "BadGateway"
        eventually(lambda: fresh.sim_get("decode", "/sim/stats")["in_flight"] == 0)
        assert fresh.sim_get("decode", "/sim/stats")["completed"] == 0


def test_prefill_5xx(fresh: Stack) -> None:
    """NIXL: the decode serves the original request alone. SGLang: a clean 502."""
    fresh.sim_post("prefill", "/sim/faults", {"prefill_status": 500})
    response = post(fresh, "/v1/chat/completions", CHAT)
    name = connector(fresh)
    if name == "nixlv2":
        assert response.status_code == 200, response.text
        (decode,) = served(fresh, "decode", 1)
        assert "kv_transfer_params" not in decode["body"]
        assert decode["body"]["max_tokens"] == CHAT["max_tokens"]
        eventually(
            lambda: (
                fresh.metric("pdproc_requests_total", outcome="decode_only", connector=name) >= 1
            )
        )
    else:
        assert response.status_code == 502
        assert "prefill failed" in response.json()["message"]


def test_unusable_prefill_answer_falls_back_to_the_decode(fresh: Stack) -> None:
    if connector(fresh) != "nixlv2":
        pytest.skip("only NIXL feeds the prefill's answer to the decode")
    fresh.sim_post("prefill", "/sim/faults", {"kv_params": "missing"})
    response = post(fresh, "/v1/chat/completions", CHAT)
    assert response.status_code == 200
    (decode,) = served(fresh, "decode", 1)
    assert "kv_transfer_params" not in decode["body"]


def test_client_hanging_up(fresh: Stack) -> None:
    """Every connector: the client leaving while its prefill runs (before the decode
    answered) cancels the prefill (nobody would use its KV) and counts `cancelled`. Once the
    decode's answer is on its way, the prefill runs on and the request counts `pd`."""
    name = connector(fresh)

    def requests(outcome: str) -> float:
        return fresh.metric("pdproc_requests_total", outcome=outcome, connector=name)

    cancelled, pd = requests("cancelled"), requests("pd")
    fresh.sim_post("prefill", "/sim/faults", {"prefill_hang": True})
    with pytest.raises(httpx.ReadTimeout):
        post(fresh, "/v1/chat/completions", CHAT, timeout_s=1.0)
    eventually(lambda: requests("cancelled") == cancelled + 1)
    assert fresh.metric("pdproc_prefills_total", outcome="cancelled") >= 1
    assert requests("pd") == pd
    if name == "nixlv2":
        assert records(fresh, "decode") == []  # sequential: the decode was never asked
    assert fresh.metric("pdproc_prefill_breaker_open") == 0
    fresh.sim_post("prefill", "/sim/faults", {"clear": True})
    before = fresh.metric("pdproc_prefills_total", outcome="2xx")
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST",
            fresh.envoy.url + "/v1/chat/completions",
            json={**CHAT, "stream": True, "max_tokens": 200},
            headers={"x-prefiller-host-port": str(fresh.sim.prefill)},
        ) as response,
    ):
        assert response.status_code == 200
        next(response.iter_bytes())  # the first chunk, then hang up
    eventually(lambda: fresh.metric("pdproc_prefills_total", outcome="2xx") > before)
    eventually(lambda: requests("pd") == pd + 1)


def test_metrics_and_errors_carry_the_connector(fresh: Stack) -> None:
    name = connector(fresh)
    assert post(fresh, "/v1/chat/completions", CHAT).status_code == 200
    page = fresh.metrics_text()
    assert f'connector="{name}"' in page
    bad = httpx.post(
        fresh.envoy.url + "/v1/chat/completions",
        content=b"[1]",
        headers={"x-prefiller-host-port": str(fresh.sim.prefill)},
    )
    assert orjson.loads(bad.content)["code"] == 400
