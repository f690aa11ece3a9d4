"""The simulated pair speaks each KV connector (`--kv-connector`): NIXL v2 and SGLang here,
through real HTTP servers on loopback (Mooncake, the default, is tests/unit/test_sim.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
from pdproc_sim import DecodeConfig, PrefillConfig, RunningDecode, RunningPrefill, start_pair
from pdproc_sim.cli import main, split_faults

CHAT = "/v1/chat/completions"
Pair = tuple[RunningPrefill, RunningDecode]


def chat_body(content: str = "Hello", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": content}]}
    body.update(extra)
    return body


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


async def wait_for_stat(
    client: httpx.AsyncClient, url: str, check: Callable[[dict[str, Any]], bool]
) -> None:
    """Poll /sim/stats (bounded) until `check` holds; no timing assumptions."""
    for _ in range(500):
        if check((await client.get(f"{url}/sim/stats")).json()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("simulator state never reached")


@pytest_asyncio.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as c:
        yield c


async def _pair(connector: str, **decode: Any) -> Pair:
    prefill_config = PrefillConfig(
        dp_ranks=2,
        engine_id_prefix="eng",
        kv_connector=connector,
        sglang_bootstrap_timeout_s=decode.pop("bootstrap_timeout_s", 5.0),
    )
    decode_config = DecodeConfig(kv_connector=connector, **{"kv_timeout_s": 5.0, **decode})
    return await start_pair(prefill_config, decode_config)


@pytest_asyncio.fixture
async def nixl() -> AsyncIterator[Pair]:
    prefill, decode = await _pair("nixlv2")
    yield prefill, decode
    await decode.close()
    await prefill.close()


# --- NIXL v2 -------------------------------------------------------------------------------

# llm-d's nixlv2 prefill leg: the client's body, these kv_transfer_params, stream false and
# every token limit 1; both legs carry the same x-request-id.
NIXL_PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def nixl_prefill_body(content: str = "Hello", **extra: Any) -> dict[str, Any]:
    return chat_body(
        content, stream=False, max_tokens=1, kv_transfer_params=NIXL_PREFILL_KV, **extra
    )


async def nixl_prefill(
    client: httpx.AsyncClient, prefill: RunningPrefill, rid: str = "req-1", **extra: Any
) -> dict[str, Any]:
    response = await client.post(
        prefill.url + CHAT, json=nixl_prefill_body(**extra), headers={"x-request-id": rid}
    )
    assert response.status_code == 200, response.text
    params: dict[str, Any] = response.json()["kv_transfer_params"]
    return params


@pytest.mark.asyncio
async def test_nixl_prefill_answers_the_decode_params_and_the_decode_reads_them(
    nixl: Pair, client: httpx.AsyncClient
) -> None:
    prefill, decode = nixl
    params = await nixl_prefill(client, prefill, "req-1")
    blocks = assert_nixl_decode_params(params, prefill)

    body = chat_body(stream=True, max_tokens=3, kv_transfer_params=params)
    response = await client.post(decode.url + CHAT, json=body, headers={"x-request-id": "req-1"})
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    await assert_decode_read_the_blocks(client, decode, blocks)
    prefill_record = (await client.get(prefill.url + "/sim/requests?limit=1")).json()
    assert prefill_record["requests"][0]["headers"]["x-request-id"] == "req-1"


def assert_nixl_decode_params(params: dict[str, Any], prefill: RunningPrefill) -> list[int]:
    """What the NIXL prefill answers for the decode, as vLLM 0.32 does; the block ids."""
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_engine_id"] in prefill.engine_ids
    assert params["remote_request_id"].startswith("chatcmpl-req-1-")
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == prefill.bootstrap_port
    # vLLM 0.32's shape: one list of block ids per KV cache group
    blocks: list[int]
    (blocks,) = params["remote_block_ids"]
    assert blocks
    assert all(isinstance(b, int) for b in blocks)
    assert params["remote_num_tokens"] > 0
    assert (params["transfer_mode"], params["remote_blocks_expiry_time"]) == ("pull", None)
    return blocks


async def assert_decode_read_the_blocks(
    client: httpx.AsyncClient, decode: RunningDecode, blocks: list[int]
) -> None:
    """The NIXL decode read those blocks, for the request id both legs carried."""
    stats = (await client.get(decode.url + "/sim/stats")).json()
    assert (stats["kv_connector"], stats["kv_ok"], stats["kv_failures"]) == ("nixlv2", 1, {})
    record = (await client.get(decode.url + "/sim/requests?limit=1")).json()["requests"][0]
    assert record["kv"]["block_ids"] == blocks
    assert record["headers"]["x-request-id"] == "req-1"


@pytest.mark.asyncio
async def test_nixl_prefill_rejects_a_streamed_leg(nixl: Pair, client: httpx.AsyncClient) -> None:
    prefill, _ = nixl
    body = {**nixl_prefill_body(), "stream": True}
    response = await client.post(prefill.url + CHAT, json=body, headers={"x-request-id": "r"})
    assert response.status_code == 400
    assert "stream=false" in response.json()["error"]["message"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (nixl_prefill_body(), {}),
        (
            chat_body(max_tokens=1, kv_transfer_params={**NIXL_PREFILL_KV, "remote_port": 1}),
            {"x-request-id": "r"},
        ),
        (chat_body(max_tokens=1, kv_transfer_params={"do_remote_decode": False}), {}),
    ],
)
async def test_nixl_prefill_serves_what_vllm_serves(
    nixl: Pair, client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]
) -> None:
    """vLLM's NIXL prefill reads only do_remote_decode and needs no x-request-id (measured by
    the contract test in tests/engines/): these are served, 200."""
    prefill, _ = nixl
    response = await client.post(prefill.url + CHAT, json=body, headers=headers)
    assert response.status_code == 200, response.text


@pytest.mark.asyncio
async def test_nixl_decode_rejects_missing_params(nixl: Pair, client: httpx.AsyncClient) -> None:
    prefill, decode = nixl
    params = await nixl_prefill(client, prefill)
    headers = {"x-request-id": "req-1"}
    for name in ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_port"):
        broken = {k: v for k, v in params.items() if k != name}
        body = chat_body(kv_transfer_params=broken)
        response = await client.post(decode.url + CHAT, json=body, headers=headers)
        assert response.status_code == 400, name
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("BadRequestError", 400)
        assert name in error["message"]
    # vLLM needs no x-request-id: a decode without one is served
    no_header = await client.post(decode.url + CHAT, json=chat_body(kv_transfer_params=params))
    assert no_header.status_code == 200, no_header.text


@pytest.mark.asyncio
async def test_nixl_decode_fails_params_that_match_no_prefill(
    nixl: Pair, client: httpx.AsyncClient
) -> None:
    prefill, decode = nixl
    headers = {"x-request-id": "req-1"}

    async def decode_with(params: dict[str, Any], rid: str = "req-1") -> str:
        response = await client.post(
            decode.url + CHAT,
            json=chat_body(kv_transfer_params=params),
            headers={"x-request-id": rid},
        )
        assert response.status_code == 500
        message: str = response.json()["error"]["message"]
        assert message.startswith("KV transfer failed: ")
        return message.split(": ")[1]

    good = await nixl_prefill(client, prefill)
    assert await decode_with({**good, "remote_request_id": "chatcmpl-nobody"}) == "unknown_request"
    assert await decode_with({**good, "remote_engine_id": "eng-x_dp0"}) == "unknown_engine"
    # The good params work once: the read frees the blocks (vLLM's done-reading notification).
    response = await client.post(
        decode.url + CHAT, json=chat_body(kv_transfer_params=good), headers=headers
    )
    assert response.status_code == 200
    assert await decode_with(good) == "unknown_request"
    blocks = await nixl_prefill(client, prefill, "req-1")
    assert await decode_with({**blocks, "remote_block_ids": [10**6]}) == "block_ids_mismatch"
    another = await nixl_prefill(client, prefill, "req-2")
    assert await decode_with(another, "req-3") == "request_id_mismatch"
    other_prompt = await nixl_prefill(client, prefill, "req-4", content="Another prompt")
    assert await decode_with(other_prompt, "req-4") == "prompt_mismatch"
    stats = (await client.get(decode.url + "/sim/stats")).json()
    assert stats["kv_ok"] == 1


@pytest.mark.asyncio
async def test_nixl_uncapped_prefill_keeps_no_kv(nixl: Pair, client: httpx.AsyncClient) -> None:
    prefill, decode = nixl
    body = chat_body(stream=False, max_tokens=5, kv_transfer_params=NIXL_PREFILL_KV)
    answer = await client.post(prefill.url + CHAT, json=body, headers={"x-request-id": "r"})
    params = answer.json()["kv_transfer_params"]
    response = await client.post(
        decode.url + CHAT, json=chat_body(kv_transfer_params=params), headers={"x-request-id": "r"}
    )
    assert "not_shipped" in response.json()["error"]["message"]


@pytest.mark.asyncio
async def test_nixl_faults(nixl: Pair, client: httpx.AsyncClient) -> None:
    prefill, decode = nixl
    await client.post(prefill.url + "/sim/faults", json={"kv_params": "missing"})
    answer = await client.post(
        prefill.url + CHAT, json=nixl_prefill_body(), headers={"x-request-id": "r"}
    )
    assert answer.status_code == 200
    assert answer.json()["kv_transfer_params"] is None
    await client.post(prefill.url + "/sim/faults", json={"clear": True, "kv_drop": True})
    dropped = await nixl_prefill(client, prefill, "r")
    headers = {"x-request-id": "r"}
    lost = await client.post(
        decode.url + CHAT, json=chat_body(kv_transfer_params=dropped), headers=headers
    )
    assert "unknown_request" in lost.json()["error"]["message"]
    await client.post(prefill.url + "/sim/faults", json={"clear": True, "bootstrap": "down"})
    params = await nixl_prefill(client, prefill, "r")
    down = await client.post(
        decode.url + CHAT, json=chat_body(kv_transfer_params=params), headers=headers
    )
    assert "bootstrap_error" in down.json()["error"]["message"]
    await client.post(prefill.url + "/sim/faults", json={"clear": True, "prefill_status": 503})
    failed = await client.post(
        prefill.url + CHAT, json=nixl_prefill_body(), headers={"x-request-id": "r"}
    )
    assert failed.status_code == 503
    stats = (await client.get(prefill.url + "/sim/stats")).json()
    assert stats["kv_dropped"] == 1


# --- SGLang --------------------------------------------------------------------------------


def sglang_body(prefill: RunningPrefill, room: int, **extra: Any) -> dict[str, Any]:
    return chat_body(
        bootstrap_host="127.0.0.1",
        bootstrap_port=prefill.bootstrap_port,
        bootstrap_room=room,
        **extra,
    )


@pytest_asyncio.fixture
async def sglang() -> AsyncIterator[Pair]:
    prefill, decode = await _pair("sglang")
    yield prefill, decode
    await decode.close()
    await prefill.close()


@pytest.mark.asyncio
async def test_sglang_legs_meet_in_the_room_whoever_comes_first(
    sglang: Pair, client: httpx.AsyncClient
) -> None:
    prefill, decode = sglang
    room = 2**63 - 1
    body = sglang_body(prefill, room, max_tokens=4, stream=True)
    async with client.stream("POST", decode.url + CHAT, json=body) as response:
        assert response.status_code == 200
        await wait_for_stat(client, prefill.url, lambda s: s["transfers"]["waiting"] == 1)
        prefilled = await client.post(prefill.url + CHAT, json=body)
        text = (await response.aread()).decode()
    assert prefilled.status_code == 200
    assert sse_events(text)[-1] == "[DONE]"
    # Prefill first: it waits for the decode to bootstrap, then both finish.
    body = sglang_body(prefill, 7, max_tokens=2)
    prefill_task = asyncio.create_task(client.post(prefill.url + CHAT, json=body))
    await wait_for_stat(client, prefill.url, lambda s: s["in_flight"] == 1)
    assert not prefill_task.done()
    decoded = await client.post(decode.url + CHAT, json=body)
    assert decoded.status_code == 200
    assert decoded.json()["usage"]["completion_tokens"] == 2
    assert (await prefill_task).status_code == 200
    stats = (await client.get(decode.url + "/sim/stats")).json()
    assert (stats["kv_ok"], stats["pd_requests"], stats["kv_connector"]) == (2, 2, "sglang")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({}, "without bootstrap room id"),
        ({"bootstrap_host": "127.0.0.1"}, "without bootstrap room id"),
        ({"bootstrap_room": 2**63}, "bootstrap_room must be"),
        ({"bootstrap_room": "12"}, "bootstrap_room must be"),
        ({"bootstrap_room": True}, "bootstrap_room must be"),
        ({"bootstrap_room": 1, "bootstrap_port": 8998}, "bootstrap_host"),
        ({"bootstrap_room": 1, "bootstrap_host": "h", "bootstrap_port": 0}, "bootstrap_port"),
    ],
)
async def test_sglang_decode_rejects_requests_without_a_valid_room(
    sglang: Pair, client: httpx.AsyncClient, extra: dict[str, Any], fragment: str
) -> None:
    _, decode = sglang
    response = await client.post(decode.url + CHAT, json=chat_body(**extra))
    assert response.status_code == 400
    error = response.json()
    assert error["object"] == "error"  # SGLang's error shape
    assert fragment in error["message"]
    assert error["code"] == 400


@pytest.mark.asyncio
async def test_sglang_decode_times_out_like_sglang(client: httpx.AsyncClient) -> None:
    prefill, decode = await _pair("sglang", kv_timeout_s=0.2)
    try:
        response = await client.post(decode.url + CHAT, json=sglang_body(prefill, 42))
        assert response.status_code == 500
        error = response.json()
        assert error["object"] == "error"
        assert error["type"] == "InternalServerError"
        message = error["message"]
        assert message.startswith("Decode transfer failed for request")
        assert "KVTransferError(bootstrap_room=42)" in message
        assert "in KVPoll.WaitingForInput" in message
        streamed = await client.post(decode.url + CHAT, json=sglang_body(prefill, 43, stream=True))
        (event,) = sse_events(streamed.text)  # one error event, no [DONE]
        assert "KVPoll.WaitingForInput" in orjson.loads(event)["error"]["message"]
    finally:
        await decode.close()
        await prefill.close()


@pytest.mark.asyncio
async def test_sglang_prefill_times_out_without_its_decode(client: httpx.AsyncClient) -> None:
    prefill, decode = await _pair("sglang", bootstrap_timeout_s=0.2)
    try:
        body = sglang_body(prefill, 9)
        response = await client.post(prefill.url + CHAT, json=body)
        assert response.status_code == 500
        assert "in KVPoll.Bootstrapping" in response.json()["message"]
        late = await client.post(decode.url + CHAT, json=body)  # fails at once
        assert late.status_code == 500
        assert "KVPoll.Bootstrapping" in late.json()["message"]
        stats = (await client.get(decode.url + "/sim/stats")).json()
        assert stats["kv_failures"] == {"prefill_failed": 1}
    finally:
        await decode.close()
        await prefill.close()


@pytest.mark.asyncio
async def test_sglang_checks_room_reuse_and_prompt(sglang: Pair, client: httpx.AsyncClient) -> None:
    prefill, decode = sglang
    body = sglang_body(prefill, 5)
    prefill_task = asyncio.create_task(client.post(prefill.url + CHAT, json=body))
    other_prompt = sglang_body(prefill, 5, messages=[{"role": "user", "content": "Other"}])
    mismatch = await client.post(decode.url + CHAT, json=other_prompt)
    assert "prompt" in mismatch.json()["message"]
    assert (await prefill_task).status_code == 200
    reused = await client.post(prefill.url + CHAT, json=body)
    assert reused.status_code == 400
    assert "already in use" in reused.json()["message"]


@pytest.mark.asyncio
async def test_sglang_lost_kv_times_out(client: httpx.AsyncClient) -> None:
    prefill, decode = await _pair("sglang", kv_timeout_s=0.2)
    try:
        await client.post(prefill.url + "/sim/faults", json={"kv_drop": True})
        body = sglang_body(prefill, 11)
        prefill_task = asyncio.create_task(client.post(prefill.url + CHAT, json=body))
        response = await client.post(decode.url + CHAT, json=body)
        assert "KVPoll.WaitingForInput" in response.json()["message"]
        assert (await prefill_task).status_code == 200  # the prefill never notices
    finally:
        await decode.close()
        await prefill.close()


# --- CLI -----------------------------------------------------------------------------------


def test_help_shows_defaults_and_repeatable_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pair", "--help"]) == 0
    out = capsys.readouterr().out
    assert "(default: 8100)" in out
    assert "(default: mooncake)" in out
    assert "repeatable" in out
    assert "nixlv2" in out
    assert "sglang" in out


def test_fault_flags_go_to_the_role_that_knows_them() -> None:
    faults = [("bootstrap", "down"), ("status", 503), ("prefill_status", 500)]
    assert split_faults("pair", faults) == (
        {"bootstrap": "down", "prefill_status": 500},
        {"status": 503},
    )
    assert split_faults("decode", [("status", 503)]) == ({}, {"status": 503})
    assert main(["pair", "--fault", "nope"]) == 2
