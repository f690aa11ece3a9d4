"""Tests for the simulated vLLM Mooncake prefill/decode pair (pdproc_sim)."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
from pdproc_sim import (
    DecodeConfig,
    PrefillConfig,
    RunningDecode,
    RunningPrefill,
    main,
    start_decode,
    start_pair,
    start_prefill,
)
from pdproc_sim.state import TransferRegistry, TransferResult

CHAT = "/v1/chat/completions"


def sim_command() -> list[str]:
    """The installed pdproc-sim console script (else `python -m pdproc_sim`)."""
    script = Path(sys.executable).with_name("pdproc-sim")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pdproc_sim"]


def chat_body(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hello"}]}
    body.update(extra)
    return body


def prefill_kv(transfer_id: str = "xfer-1") -> dict[str, Any]:
    return {"do_remote_prefill": False, "do_remote_decode": True, "transfer_id": transfer_id}


def decode_kv(
    prefill: RunningPrefill, engine_id: str, transfer_id: str = "xfer-1"
) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": prefill.bootstrap_url,
        "remote_engine_id": engine_id,
    }


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


@pytest_asyncio.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as c:
        yield c


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[tuple[RunningPrefill, RunningDecode]]:
    prefill, decode = await start_pair(
        PrefillConfig(dp_ranks=2, engine_id_prefix="eng"), DecodeConfig(kv_timeout_s=5)
    )
    yield prefill, decode
    await decode.close()
    await prefill.close()


async def wait_for_stat(client: httpx.AsyncClient, url: str, key: str, value: Any) -> None:
    """Poll /sim/stats until a counter reaches a value (no timing assumptions, bounded)."""
    for _ in range(500):
        if (await client.get(f"{url}/sim/stats")).json()[key] == value:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{key} never became {value}")


# --- prefill -----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_decode": True},  # no transfer_id (vLLM: "Missing transfer_id ...")
        {**prefill_kv(), "do_remote_decode": False},  # neither flag set
        prefill_kv(""),
    ],
)
async def test_prefill_serves_params_without_a_transfer_as_vllm_does(
    pair: tuple[RunningPrefill, RunningDecode],
    client: httpx.AsyncClient,
    params: dict[str, Any],
) -> None:
    """A real vLLM prefill logs a warning and serves such a request without keeping its KV
    (measured by the contract test in tests/engines/): 200, nothing shipped."""
    prefill, _ = pair
    response = await client.post(
        prefill.url + CHAT, json=chat_body(max_tokens=1, kv_transfer_params=params)
    )
    assert response.status_code == 200, response.text
    stats = (await client.get(prefill.url + "/sim/stats")).json()
    assert stats["transfers"]["shipped"] == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (chat_body(max_tokens=1, kv_transfer_params="x"), "must be an object"),
        (
            chat_body(max_tokens=1, kv_transfer_params={**prefill_kv(), "do_remote_prefill": True}),
            "do_remote_decode=true",
        ),
        (chat_body(max_tokens=1, min_tokens=2, kv_transfer_params=prefill_kv()), "min_tokens"),
        (chat_body(max_tokens=1, n=2, kv_transfer_params=prefill_kv()), "n=2"),
        (chat_body(max_tokens=1, best_of=3, kv_transfer_params=prefill_kv()), "best_of=3"),
        (chat_body(max_tokens=0), "max_tokens must be at least 1"),
    ],
)
async def test_prefill_rejects_invalid_requests(
    pair: tuple[RunningPrefill, RunningDecode],
    client: httpx.AsyncClient,
    body: dict[str, Any],
    fragment: str,
) -> None:
    prefill, _ = pair
    response = await client.post(prefill.url + CHAT, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert fragment in error["message"]
    assert error["code"] == 400
    assert error["type"] == "BadRequestError"


@pytest.mark.asyncio
async def test_prefill_rejects_non_object_body(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, _ = pair
    for content in (b"[1, 2]", b"{not json"):
        response = await client.post(prefill.url + CHAT, content=content)
        assert response.status_code == 400


@pytest.mark.asyncio
async def test_prefill_rank_header(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, _ = pair
    body = chat_body(max_tokens=1)
    bad = await client.post(prefill.url + CHAT, json=body, headers={"x-DATA-parallel-rank": "2"})
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."
    ok = await client.post(prefill.url + CHAT, json=body, headers={"X-Data-Parallel-Rank": "1"})
    assert ok.status_code == 200
    for _ in range(2):  # a non-integer is ignored: round-robin over both ranks
        ignored = await client.post(
            prefill.url + CHAT, json=body, headers={"X-data-parallel-rank": "x"}
        )
        assert ignored.status_code == 200
    records = (await client.get(prefill.url + "/sim/requests?limit=3")).json()["requests"]
    assert records[0]["rank"] == 1
    assert records[0]["headers"]["x-data-parallel-rank"] == "1"
    assert {records[1]["rank"], records[2]["rank"]} == {0, 1}


@pytest.mark.asyncio
async def test_prefill_answer_shape(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, _ = pair
    body = chat_body(max_tokens=1, stream=False, kv_transfer_params=prefill_kv("xfer-shape"))
    response = await client.post(prefill.url + CHAT, json=body)
    assert response.status_code == 200
    data = response.json()
    assert data["object"] == "chat.completion"
    assert data["usage"]["completion_tokens"] == 1
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["kv_transfer_params"] is None
    stats = (await client.get(prefill.url + "/sim/stats")).json()
    assert stats["transfers"]["shipped"] == 1
    assert sum(stats["prefills_per_rank"].values()) == 1


@pytest.mark.asyncio
async def test_bootstrap_query_shape(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, _ = pair
    data = (await client.get(f"{prefill.bootstrap_url}/query")).json()
    assert set(data) == {"0", "1"}
    for rank in ("0", "1"):
        entry = data[rank]
        assert entry["engine_id"] == f"eng_dp{rank}"
        assert entry["worker_addr"]["0"]["0"].startswith("tcp://127.0.0.1:")
    assert prefill.engine_ids == ["eng_dp0", "eng_dp1"]


@pytest.mark.asyncio
async def test_restart_changes_engine_ids(client: httpx.AsyncClient) -> None:
    async with await start_prefill(PrefillConfig(dp_ranks=2)) as prefill:
        before = (await client.get(f"{prefill.bootstrap_url}/query")).json()
        assert before["0"]["engine_id"].endswith("_dp0")
        restarted = (await client.post(prefill.url + "/sim/restart")).json()
        assert restarted["generation"] == 1
        assert restarted["engine_ids"] == {"0": prefill.engine_ids[0], "1": prefill.engine_ids[1]}
        after = (await client.get(f"{prefill.bootstrap_url}/query")).json()
        assert {e["engine_id"] for e in before.values()}.isdisjoint(
            e["engine_id"] for e in after.values()
        )


# --- P/D ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_decode_waits_for_prefill_then_streams(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, decode = pair
    decode_body = chat_body(
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        kv_transfer_params=decode_kv(prefill, "eng_dp1"),
    )
    async with client.stream("POST", decode.url + CHAT, json=decode_body) as response:
        # Headers come first, as vLLM sends them before the KV arrives.
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        await wait_for_stat(client, prefill.url, "transfers", {**_transfers(0), "waiting": 1})
        prefill_body = chat_body(max_tokens=1, kv_transfer_params=prefill_kv())
        headers = {"X-data-parallel-rank": "1"}
        assert (
            await client.post(prefill.url + CHAT, json=prefill_body, headers=headers)
        ).is_success
        text = (await response.aread()).decode()
    assert_chat_stream_of(text, 4)
    await assert_decode_read_the_kv_of(client, decode, "eng_dp1", 1)


def assert_chat_stream_of(text: str, tokens: int) -> None:
    """An OpenAI chat stream: the assistant's role, `tokens` pieces of content ended by
    the length limit, a usage chunk, then [DONE]."""
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert len([c for c in content if c]) == tokens
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == tokens


async def assert_decode_read_the_kv_of(
    client: httpx.AsyncClient, decode: RunningDecode, engine_id: str, rank: int
) -> None:
    """The decode's one request completed with the KV shipped by that engine and rank."""
    stats = (await client.get(decode.url + "/sim/stats")).json()
    assert (stats["kv_ok"], stats["completed"], stats["kv_failures"]) == (1, 1, {})
    record = (await client.get(decode.url + "/sim/requests?limit=1")).json()["requests"][0]
    assert record["kv"]["reason"] is None
    assert (record["kv"]["engine_id"], record["kv"]["dp_rank"]) == (engine_id, rank)
    assert record["kv"]["shipped"] is True


def _transfers(shipped: int) -> dict[str, int]:
    return {"shipped": shipped, "not_shipped": 0, "stored": shipped, "waiting": 0}


@pytest.mark.asyncio
async def test_prefill_first_then_non_streaming_decode(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, decode = pair
    prefill_body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 1,
        "kv_transfer_params": prefill_kv(),
    }
    headers = {"X-data-parallel-rank": "0"}
    assert (
        await client.post(prefill.url + "/v1/completions", json=prefill_body, headers=headers)
    ).is_success
    body = {"prompt": "hi", "max_tokens": 3, "kv_transfer_params": decode_kv(prefill, "eng_dp0")}
    response = await client.post(decode.url + "/v1/completions", json=body)
    assert response.status_code == 200
    data = response.json()
    assert data["object"] == "text_completion"
    assert data["usage"]["completion_tokens"] == 3
    assert data["kv_transfer_params"] is None


@pytest.mark.asyncio
async def test_engine_mismatch_fails_decode(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, decode = pair
    headers = {"X-data-parallel-rank": "0"}
    prefill_body = chat_body(max_tokens=1, kv_transfer_params=prefill_kv())
    assert (await client.post(prefill.url + CHAT, json=prefill_body, headers=headers)).is_success
    body = chat_body(kv_transfer_params=decode_kv(prefill, "eng_dp1"))
    response = await client.post(decode.url + CHAT, json=body)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["message"].startswith("KV transfer failed: engine_mismatch")
    assert (error["type"], error["code"]) == ("InternalServerError", 500)
    stats = (await client.get(decode.url + "/sim/stats")).json()
    assert stats["kv_failures"] == {"engine_mismatch": 1}


@pytest.mark.asyncio
async def test_uncapped_prefill_is_not_shipped(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, decode = pair
    headers = {"X-data-parallel-rank": "0"}
    prefill_body = chat_body(max_tokens=5, kv_transfer_params=prefill_kv())
    assert (await client.post(prefill.url + CHAT, json=prefill_body, headers=headers)).is_success
    body = chat_body(kv_transfer_params=decode_kv(prefill, "eng_dp0"))
    response = await client.post(decode.url + CHAT, json=body)
    assert response.status_code == 500
    assert "not_shipped" in response.json()["error"]["message"]


@pytest.mark.asyncio
async def test_missing_prefill_times_out_streaming(client: httpx.AsyncClient) -> None:
    async with (
        await start_prefill(PrefillConfig(engine_id_prefix="e")) as prefill,
        await start_decode(DecodeConfig(kv_timeout_s=0.3)) as decode,
    ):
        body = chat_body(stream=True, kv_transfer_params=decode_kv(prefill, "e_dp0"))
        response = await client.post(decode.url + CHAT, json=body)
        assert response.status_code == 200
        events = sse_events(response.text)
        assert len(events) == 1  # one error event, no [DONE]
        error = orjson.loads(events[0])["error"]
        assert error["message"].startswith("KV transfer failed: timeout")
        assert error["code"] == 500


@pytest.mark.asyncio
async def test_a_restart_leaves_mooncake_decodes_waiting_silently(
    client: httpx.AsyncClient,
) -> None:
    """As vLLM: a decode whose prefill engine died, or that is told an engine it knew
    before its pod restarted, hears nothing until its abort timeout (480 s in vLLM; 0.5 s
    here), never a quick error; an engine id it never knew is looked up in /query and fails
    at once."""
    async with (
        await start_prefill(PrefillConfig(engine_id_prefix="eng")) as prefill,
        await start_decode(DecodeConfig(kv_timeout_s=0.5)) as decode,
    ):
        body = chat_body(kv_transfer_params=decode_kv(prefill, "eng_dp0"))
        waiting = asyncio.create_task(client.post(decode.url + CHAT, json=body))
        await wait_for_stat(client, prefill.url, "transfers", {**_transfers(0), "waiting": 1})
        await client.post(prefill.url + "/sim/restart")
        response = await waiting
        assert response.status_code == 500
        assert response.json()["error"]["message"].startswith("KV transfer failed: timeout")

        # The new engine pushes the transfer, but the decode was told the old one: it still
        # hears nothing (its socket is the dead engine's).
        stale = chat_body(kv_transfer_params=decode_kv(prefill, "eng_dp0", "xfer-2"))
        pushed = chat_body(max_tokens=1, kv_transfer_params=prefill_kv("xfer-2"))
        assert (await client.post(prefill.url + CHAT, json=pushed)).is_success
        response = await client.post(decode.url + CHAT, json=stale)
        assert response.json()["error"]["message"].startswith("KV transfer failed: timeout")

        never = chat_body(kv_transfer_params=decode_kv(prefill, "nobody_dp0", "xfer-3"))
        response = await client.post(decode.url + CHAT, json=never)
        assert response.status_code == 500
        assert "unknown_engine" in response.json()["error"]["message"]
        assert "not found from bootstrap server" in response.json()["error"]["message"]

        fresh = chat_body(kv_transfer_params=decode_kv(prefill, "eng-r1_dp0", "xfer-2"))
        assert (await client.post(decode.url + CHAT, json=fresh)).status_code == 200
        stats = (await client.get(decode.url + "/sim/stats")).json()
        assert stats["kv_failures"] == {"timeout": 2, "unknown_engine": 1}


@pytest.mark.asyncio
async def test_decode_counts_client_disconnect(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, decode = pair
    body = chat_body(stream=True, kv_transfer_params=decode_kv(prefill, "eng_dp0"))
    async with client.stream("POST", decode.url + CHAT, json=body) as response:
        assert response.status_code == 200
        await wait_for_stat(client, prefill.url, "kv_polls", 1)
    # Leaving the block unread closes the connection: the decode must stop and count it.
    await wait_for_stat(client, decode.url, "cancelled", 1)
    await wait_for_stat(client, decode.url, "in_flight", 0)
    await wait_for_stat(client, prefill.url, "transfers", {**_transfers(0), "waiting": 0})


@pytest.mark.asyncio
async def test_decode_validates_kv_params(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, decode = pair
    good = decode_kv(prefill, "eng_dp0")
    for broken in (
        {**good, "remote_engine_id": ""},
        {**good, "do_remote_decode": True},
        {key: v for key, v in good.items() if key != "remote_bootstrap_addr"},
    ):
        response = await client.post(decode.url + CHAT, json=chat_body(kv_transfer_params=broken))
        assert response.status_code == 400


@pytest.mark.asyncio
async def test_unreachable_bootstrap_fails_decode(client: httpx.AsyncClient) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with await start_decode() as decode:
        kv = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": "xfer-x",
            "remote_bootstrap_addr": f"http://127.0.0.1:{port}",
            "remote_engine_id": "e",
        }
        response = await client.post(decode.url + CHAT, json=chat_body(kv_transfer_params=kv))
        assert response.status_code == 500
        assert "bootstrap_unreachable" in response.json()["error"]["message"]


# --- unified decode, passthrough, introspection ------------------------------------------


@pytest.mark.asyncio
async def test_unified_decode_shapes(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    _, decode = pair
    chat = (await client.post(decode.url + CHAT, json=chat_body())).json()
    assert chat["usage"]["completion_tokens"] == 16  # --default-tokens
    assert chat["choices"][0]["message"]["role"] == "assistant"
    streamed = await client.post(
        decode.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}
    )
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    assert [orjson.loads(e)["choices"][0]["text"] for e in events[:-1]] == [" The", " quick"]
    responses = await client.post(decode.url + "/v1/responses", json={"input": "x"})
    assert responses.json()["object"] == "response"
    generate = await client.post(
        decode.url + "/inference/v1/generate",
        json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}},
    )
    assert len(generate.json()["choices"][0]["token_ids"]) == 3
    models = (await client.get(decode.url + "/v1/models")).json()
    assert models["data"][0]["id"] == "sim-model"
    assert (await client.get(decode.url + "/health")).status_code == 200


@pytest.mark.asyncio
async def test_decode_passthrough_and_records(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    _, decode = pair
    response = await client.get(decode.url + "/v1/chat/completions?a=1", headers={"X-Thing": "v"})
    assert response.json() == {"path": "/v1/chat/completions", "method": "GET"}
    response = await client.post(decode.url + "/v1/embeddings", json={"input": "x"})
    assert response.json() == {"path": "/v1/embeddings", "method": "POST"}
    records = (await client.get(decode.url + "/sim/requests")).json()
    assert records["total_received"] == 2
    first, second = records["requests"]
    assert (first["method"], first["query"], first["headers"]["x-thing"]) == ("GET", "a=1", "v")
    assert second["body"] == {"input": "x"}
    filtered = await client.get(decode.url + "/sim/requests?path=/v1/embeddings")
    assert len(filtered.json()["requests"]) == 1
    await client.post(decode.url + "/sim/reset")
    assert (await client.get(decode.url + "/sim/requests")).json()["requests"] == []
    assert (await client.get(decode.url + "/sim/stats")).json()["requests"] == {}


@pytest.mark.asyncio
async def test_large_body_record_is_shortened(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    _, decode = pair
    prompt = "x" * (1024 * 1024)
    response = await client.post(
        decode.url + CHAT,
        json=chat_body(max_tokens=1, messages=[{"role": "user", "content": prompt}]),
    )
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == len(prompt) // 4
    record = (await client.get(decode.url + "/sim/requests?limit=1")).json()["requests"][0]
    assert record["body_truncated"] is True
    assert record["body"]["max_tokens"] == 1
    assert len(record["body"]["messages"][0]["content"]) < 1000


# --- faults ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_prefill_status_fault(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, _ = pair
    faults = await client.post(prefill.url + "/sim/faults", json={"prefill_status": 500})
    assert faults.json()["prefill_status"] == 500
    body = chat_body(max_tokens=1, kv_transfer_params=prefill_kv())
    assert (await client.post(prefill.url + CHAT, json=body)).status_code == 500
    await client.post(prefill.url + "/sim/faults", json={"prefill_status": None})
    assert (await client.post(prefill.url + CHAT, json=body)).status_code == 200
    invalid = await client.post(prefill.url + "/sim/faults", json={"bootstrap": "weird"})
    assert invalid.status_code == 400
    unknown = await client.post(prefill.url + "/sim/faults", json={"nope": 1})
    assert unknown.status_code == 400


@pytest.mark.asyncio
async def test_bootstrap_faults(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, _ = pair
    query = f"{prefill.bootstrap_url}/query"
    await client.post(prefill.url + "/sim/faults", json={"bootstrap": "garbage"})
    garbage = await client.get(query)
    assert garbage.status_code == 200
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(garbage.content)
    await client.post(prefill.url + "/sim/faults", json={"bootstrap": "empty"})
    assert (await client.get(query)).json() == {}
    await client.post(prefill.url + "/sim/faults", json={"bootstrap": "down"})
    assert (await client.get(query)).status_code == 503
    await client.post(
        prefill.url + "/sim/faults", json={"bootstrap": "slow", "bootstrap_delay_s": 0.01}
    )
    assert set((await client.get(query)).json()) == {"0", "1"}
    await client.post(prefill.url + "/sim/faults", json={"bootstrap": "ok"})
    assert set((await client.get(query)).json()) == {"0", "1"}
    stats = (await client.get(prefill.url + "/sim/stats")).json()
    assert stats["bootstrap_queries"] == 5
    assert stats["faults"]["bootstrap_delay_s"] == 0.01


@pytest.mark.asyncio
async def test_prefill_hang_released(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    prefill, _ = pair
    await client.post(prefill.url + "/sim/faults", json={"prefill_hang": True})
    body = chat_body(max_tokens=1, kv_transfer_params=prefill_kv())
    hung = asyncio.create_task(client.post(prefill.url + CHAT, json=body))
    await wait_for_stat(client, prefill.url, "in_flight", 1)
    assert not hung.done()
    await client.post(prefill.url + "/sim/faults", json={"clear": True})
    assert (await hung).status_code == 200


@pytest.mark.asyncio
async def test_decode_status_fault(
    pair: tuple[RunningPrefill, RunningDecode], client: httpx.AsyncClient
) -> None:
    _, decode = pair
    await client.post(decode.url + "/sim/faults", json={"status": 503})
    assert (await client.post(decode.url + CHAT, json=chat_body())).status_code == 503
    await client.post(decode.url + "/sim/faults", json={"status": None})
    assert (await client.post(decode.url + CHAT, json=chat_body())).status_code == 200


# --- registry, IPv6, CLI -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_registry_ttl_and_cap() -> None:
    now = [0.0]
    registry = TransferRegistry(ttl_s=10, cap=2, clock=lambda: now[0])
    result = TransferResult("e", 0, True)
    for name in ("a", "b", "c"):
        registry.complete(name, result)
    assert registry.lookup("a") is None  # over the cap: oldest dropped
    assert registry.lookup("c") == result
    now[0] = 11
    assert registry.lookup("c") is None  # expired
    assert await registry.wait("d", 0) == "timeout"
    assert registry.waiting == 0


def _ipv6_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.asyncio
@pytest.mark.skipif(not _ipv6_available(), reason="no IPv6 loopback")
async def test_ipv6_pair(client: httpx.AsyncClient) -> None:
    prefill, decode = await start_pair(
        PrefillConfig(host="::1", engine_id_prefix="v6"), DecodeConfig(host="::1", kv_timeout_s=5)
    )
    try:
        assert prefill.bootstrap_url is not None
        assert prefill.bootstrap_url.startswith("http://[::1]:")
        body = chat_body(max_tokens=1, kv_transfer_params=prefill_kv())
        assert (await client.post(prefill.url + CHAT, json=body)).status_code == 200
        decode_body = chat_body(kv_transfer_params=decode_kv(prefill, "v6_dp0"))
        assert (await client.post(decode.url + CHAT, json=decode_body)).status_code == 200
    finally:
        await decode.close()
        await prefill.close()


@pytest.mark.asyncio
async def test_cli_pair_ready_line_and_sigterm(client: httpx.AsyncClient, tmp_path: Path) -> None:
    # The installed console script, run outside the checkout.
    args = ["pair", "--prefill-port", "0", "--bootstrap-port", "0"]
    process = await asyncio.create_subprocess_exec(
        *sim_command(),
        *args,
        "--decode-port",
        "0",
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        ready = orjson.loads(await asyncio.wait_for(process.stdout.readline(), 20))
        assert ready["ready"] is True
        assert set(ready) == {"ready", "kv_connector", "prefill", "bootstrap", "decode"}
        assert ready["kv_connector"] == "mooncake"
        assert (await client.get(f"http://{ready['decode']}/health")).status_code == 200
        assert (await client.get(f"http://{ready['bootstrap']}/query")).json()["0"]["engine_id"]
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 20) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_cli_rejects_bad_arguments() -> None:
    assert main(["prefill", "--dp-ranks", "0"]) == 2
    assert main(["nope"]) == 2


def test_pdproc_cli_delegates_sim_and_demo(capsys: pytest.CaptureFixture[str]) -> None:
    from pdproc.cli import main as pdproc_main

    assert pdproc_main(["sim", "nope"]) == 2
    assert pdproc_main(["demo", "--help"]) == 0
    assert "--port" in capsys.readouterr().out


def test_sim_distribution_version_follows_pdproc() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[2]
    pdproc = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    sim = tomllib.loads((root / "sim" / "pyproject.toml").read_text())["project"]
    assert sim["version"] == pdproc["version"]
    assert f"pdproc=={pdproc['version']}" in sim["dependencies"]
