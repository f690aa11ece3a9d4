"""Client -> real Envoy -> pdproc (ext_proc) -> simulated vLLM prefill/decode pair."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from pdproc_sim.devstack import Stack

from tests.stacks import records, served
from tests.waiting import eventually

from .conftest import ext_proc_errors, forget_engine_ids

pytestmark = pytest.mark.e2e

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 50}
CHAT_MCT = {**CHAT, "max_completion_tokens": 100}


def target(stack: Stack) -> dict[str, str]:
    return {"x-prefiller-host-port": str(stack.sim.prefill)}


def assert_paired(prefill: dict[str, Any], decode: dict[str, Any], engine_ids: dict[str, str]):
    p_kv = prefill["body"]["kv_transfer_params"]
    d_kv = decode["body"]["kv_transfer_params"]
    assert p_kv["do_remote_decode"] is True
    assert p_kv["do_remote_prefill"] is False
    assert d_kv["do_remote_prefill"] is True
    assert d_kv["do_remote_decode"] is False
    assert p_kv["transfer_id"] == d_kv["transfer_id"]
    assert d_kv["transfer_id"].startswith("xfer-")
    rank = prefill["headers"]["x-data-parallel-rank"]
    assert d_kv["remote_engine_id"] == engine_ids[rank]
    assert decode["kv"]["reason"] is None or decode["kv"]["reason"] == "ok"


def test_llm_d_case_concurrent_requests_with_mooncake_params(fresh: Stack) -> None:
    """llm-d: "should send concurrent requests with correct mooncake kv_transfer_params"."""
    response = httpx.post(
        fresh.envoy.url + "/v1/chat/completions", json=CHAT_MCT, headers=target(fresh), timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"
    (prefill,) = served(fresh, "prefill", 1)
    (decode,) = served(fresh, "decode", 1)
    p_body, d_body = prefill["body"], decode["body"]
    assert (p_body["max_tokens"], p_body["max_completion_tokens"], p_body["stream"]) == (
        1,
        1,
        False,
    )
    assert (d_body["max_tokens"], d_body["max_completion_tokens"]) == (50, 100)
    assert d_body["kv_transfer_params"]["remote_bootstrap_addr"].endswith(
        f":{fresh.sim.bootstrap.port}"
    )
    assert prefill["headers"]["x-data-parallel-rank"] in ("0", "1")
    assert "x-prefiller-host-port" not in decode["headers"]
    if "content-length" in decode["headers"]:
        assert int(decode["headers"]["content-length"]) == decode["body_bytes"]
    else:  # single-message mode: headers left before the body was rewritten
        assert decode["headers"]["transfer-encoding"] == "chunked"
    assert_paired(prefill, decode, fresh.sim_get("prefill", "/sim/stats")["engine_ids"])
    assert decode["kv"]["shipped"] is True


def test_llm_d_case_dp_ranks_are_pinned_and_paired(fresh: Stack) -> None:
    """llm-d: "should pin prefill to the selected dp rank and send its engine_id to decode"."""
    with httpx.Client(timeout=30) as client:
        for _ in range(12):
            response = client.post(
                fresh.envoy.url + "/v1/completions",
                json={"model": "m", "prompt": "hi", "max_tokens": 3},
                headers=target(fresh),
            )
            assert response.status_code == 200, response.text
    prefills = {
        r["body"]["kv_transfer_params"]["transfer_id"]: r for r in served(fresh, "prefill", 12)
    }
    decodes = served(fresh, "decode", 12)
    engine_ids = fresh.sim_get("prefill", "/sim/stats")["engine_ids"]
    for decode in decodes:
        assert_paired(
            prefills[decode["body"]["kv_transfer_params"]["transfer_id"]], decode, engine_ids
        )
    ranks = {p["headers"]["x-data-parallel-rank"] for p in prefills.values()}
    assert ranks == {"0", "1"}  # load spread over both ranks


def test_llm_d_case_prefill_slower_than_decode(fresh: Stack) -> None:
    """llm-d: "should not panic when prefill response is slower than decode response".

    Here the decode's answer is held until the prefill has answered, so the client gets a
    complete 200 and both pods served exactly one request."""
    fresh.sim_post("prefill", "/sim/faults", {"prefill_hang": True})
    with httpx.Client(timeout=30) as client:
        pending = client.build_request(
            "POST", fresh.envoy.url + "/v1/chat/completions", json=CHAT, headers=target(fresh)
        )
        import threading

        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(r=client.send(pending)))
        thread.start()
        eventually(lambda: fresh.sim_get("prefill", "/sim/stats")["in_flight"] == 1)
        fresh.sim_post("prefill", "/sim/faults", {"prefill_hang": False})
        thread.join(30)
    assert result["r"].status_code == 200
    served(fresh, "prefill", 1)
    served(fresh, "decode", 1)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 8}),
    ],
)
def test_streaming_arrives_incrementally(fresh: Stack, path: str, body: dict[str, Any]) -> None:
    payload = {**body, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    reads = stream_reads(fresh, path, payload)
    assert_events_end_with_usage(b"".join(reads).decode(), 8)
    # 8 tokens 20 ms apart reach the client as separate reads, not one buffered blob.
    assert len(reads) >= 4
    assert_stream_flags_on_the_decode_only(fresh)


def stream_reads(stack: Stack, path: str, payload: dict[str, Any]) -> list[bytes]:
    """A streamed request through Envoy: the bytes as each read returned them."""
    reads: list[bytes] = []
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", stack.envoy.url + path, json=payload, headers=target(stack)) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        reads.extend(r.iter_raw())
    return reads


def assert_events_end_with_usage(text: str, tokens: int) -> None:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == tokens


def assert_stream_flags_on_the_decode_only(stack: Stack) -> None:
    (decode,) = served(stack, "decode", 1)
    assert decode["body"]["stream"] is True  # the decode keeps the client's stream flags
    assert decode["body"]["stream_options"] == {"include_usage": True}
    (prefill,) = served(stack, "prefill", 1)
    assert prefill["body"]["stream"] is False
    assert "stream_options" not in prefill["body"]


def test_non_streaming_completions(fresh: Stack) -> None:
    response = httpx.post(
        fresh.envoy.url + "/v1/completions",
        json={"model": "m", "prompt": "Hello", "max_tokens": 4},
        headers=target(fresh),
        timeout=30,
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4


def test_open_paths_reach_the_decode_guarded_and_others_get_404(fresh: Stack) -> None:
    with httpx.Client(timeout=30) as client:
        models = client.get(fresh.envoy.url + "/v1/models", headers=target(fresh))
        get_chat = client.get(fresh.envoy.url + "/v1/chat/completions", headers=target(fresh))
        embed = client.post(
            fresh.envoy.url + "/v1/embeddings",
            json={"model": "m", "input": "x"},
            headers=target(fresh),
        )
        smuggled = client.post(
            fresh.envoy.url + "/v1/models",
            json={"model": "m", "kv_transfer_params": {"a": 1}},
            headers=target(fresh),
        )
    assert models.status_code == get_chat.status_code == 200
    # Not a P/D path and not opened (--open-path): refused by the config's default deny.
    assert embed.status_code == 404
    assert embed.json()["type"] == "NotFoundError"
    # An open path skips pdproc, not the kv guard.
    assert smuggled.status_code == 400
    assert "kv_transfer_params" in smuggled.json()["message"]
    decodes = served(fresh, "decode", 1)  # /v1/models is answered but not recorded
    assert [r["path"] for r in decodes] == ["/v1/chat/completions"]
    for record in decodes:
        assert "x-prefiller-host-port" not in record["headers"]
    assert records(fresh, "prefill") == []


def test_no_target_means_decode_does_it_all(fresh: Stack) -> None:
    response = httpx.post(fresh.envoy.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 200
    (decode,) = served(fresh, "decode", 1)
    assert "kv_transfer_params" not in decode["body"]
    assert records(fresh, "prefill") == []


def test_disallowed_target_gets_403_and_no_traffic(fresh: Stack) -> None:
    # 127.0.0.2 is loopback but outside the stack's --prefill-allow 127.0.0.1/32.
    bad = {"x-prefiller-host-port": f"127.0.0.2:{fresh.sim.prefill.port}"}
    response = httpx.post(fresh.envoy.url + "/v1/chat/completions", json=CHAT, headers=bad)
    assert response.status_code == 403
    assert response.headers["content-type"] == "application/json"
    assert response.json()["type"] == "PermissionDeniedError"
    assert records(fresh, "prefill") == []
    assert records(fresh, "decode") == []


def test_invalid_json_gets_400(fresh: Stack) -> None:
    response = httpx.post(
        fresh.envoy.url + "/v1/chat/completions",
        content=b"{broken",
        headers={**target(fresh), "content-type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()
    assert (error["object"], error["type"], error["code"]) == ("error", "BadRequestError", 400)
    assert records(fresh, "decode") == []


@pytest.mark.parametrize("fault", ["down", "garbage", "empty"])
def test_bootstrap_failure_gets_502(fresh: Stack, fault: str) -> None:
    forget_engine_ids(fresh)
    fresh.sim_post("prefill", "/sim/reset")
    fresh.sim_post("decode", "/sim/reset")
    fresh.sim_post("prefill", "/sim/faults", {"bootstrap": fault})
    response = httpx.post(
        fresh.envoy.url + "/v1/chat/completions", json=CHAT, headers=target(fresh)
    )
    assert response.status_code == 502
    assert response.json()["type"] == "BadGateway"
    assert records(fresh, "decode") == []
    assert records(fresh, "prefill") == []


def test_failed_prefill_is_a_fast_502_and_the_decode_is_cancelled(fresh: Stack) -> None:
    fresh.sim_post("prefill", "/sim/faults", {"prefill_status": 500})
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST",
            fresh.envoy.url + "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers=target(fresh),
        ) as response,
    ):
        body = response.read()
    assert response.status_code == 502
    error = orjson.loads(body)
    assert error["type"] == "BadGateway"
    assert "prefill failed" in error["message"]
    assert response.headers["x-pdproc-error"] == "prefill_failed"
    # The decode had started waiting for KV and Envoy reset it when pdproc aborted (or it
    # learnt from the prefill pod that the KV never comes, or, when the prefill failed
    # first, Envoy never sent it): nothing is left waiting and no decode ran to the end.
    eventually(lambda: fresh.sim_get("decode", "/sim/stats")["in_flight"] == 0)
    assert fresh.sim_get("decode", "/sim/stats")["completed"] == 0


def test_four_mib_prompt(fresh: Stack) -> None:
    prompt = "tok " * (1024 * 1024)  # 4 MiB of prompt text
    response = httpx.post(
        fresh.envoy.url + "/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 2},
        headers=target(fresh),
        timeout=60,
    )
    assert response.status_code == 200, response.text[:200]
    (decode,) = served(fresh, "decode", 1)
    assert decode["body_bytes"] > 4 * 1024 * 1024
    (prefill,) = served(fresh, "prefill", 1)
    assert prefill["body_bytes"] > 4 * 1024 * 1024


def test_200_requests_at_concurrency_20_all_paired(fresh: Stack) -> None:
    before = fresh.metric("pdproc_requests_total", outcome="pd")

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=20)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            gate = asyncio.Semaphore(20)

            async def one(i: int) -> int:
                async with gate:
                    response = await client.post(
                        fresh.envoy.url + ("/v1/chat/completions" if i % 2 else "/v1/completions"),
                        json={**CHAT, "prompt": f"p{i}", "max_tokens": 2, "stream": i % 3 == 0},
                        headers=target(fresh),
                    )
                    await response.aread()
                    return response.status_code

            return await asyncio.gather(*(one(i) for i in range(200)))

    statuses = asyncio.run(run())
    assert statuses == [200] * 200
    prefills = {
        r["body"]["kv_transfer_params"]["transfer_id"]: r for r in served(fresh, "prefill", 200)
    }
    decodes = served(fresh, "decode", 200)
    engine_ids = fresh.sim_get("prefill", "/sim/stats")["engine_ids"]
    assert len(prefills) == 200
    for decode in decodes:
        assert_paired(
            prefills[decode["body"]["kv_transfer_params"]["transfer_id"]], decode, engine_ids
        )
    eventually(lambda: fresh.metric("pdproc_requests_total", outcome="pd") - before == 200)
    assert fresh.metric("pdproc_prefills_in_flight") == 0


def test_envoy_ext_proc_error_stats_stay_zero(stack: Stack) -> None:
    """Runs last in this module: after everything above, Envoy saw no protocol errors."""
    assert ext_proc_errors(stack) == dict.fromkeys(ext_proc_errors(stack), 0)
    assert (
        stack.envoy.stats("http.ingress.ext_proc.")["http.ingress.ext_proc.streams_started"] > 200
    )


def test_logs_are_json_lines_with_request_fields_and_no_secrets(fresh: Stack) -> None:
    secret = "Bearer sk-do-not-log-me"
    prompt = "a prompt that must never reach the logs"
    body = {**CHAT, "messages": [{"role": "user", "content": prompt}]}
    headers = {**target(fresh), "authorization": secret, "x-request-id": "req-log-check"}
    assert httpx.post(
        fresh.envoy.url + "/v1/chat/completions", json=body, headers=headers
    ).is_success
    bad = httpx.post(fresh.envoy.url + "/v1/chat/completions", content=b"[]", headers=target(fresh))
    assert bad.status_code == 400

    entries = log_entries_once(fresh, "req-log-check")
    assert_prefilled_line(fresh, entries, "req-log-check")
    rejected = [e for e in entries if e.get("outcome") == "bad_request"]
    assert rejected
    assert rejected[-1]["level"] == "warning"
    assert rejected[-1]["status"] == 400
    text = fresh.pdproc.log_path.read_text()
    assert "sk-do-not-log-me" not in text
    assert prompt not in text


def log_entries_once(stack: Stack, request_id: str) -> list[dict[str, Any]]:
    """pdproc's log, every line one JSON object, once a line of `request_id` is there."""

    def logged() -> list[dict[str, Any]]:
        lines = stack.pdproc.log_path.read_text().splitlines()
        return [orjson.loads(line) for line in lines]  # every line is one JSON object

    def request_logged() -> list[dict[str, Any]] | None:
        entries = logged()
        return entries if any(e.get("request_id") == request_id for e in entries) else None

    entries: list[dict[str, Any]] = eventually(request_logged)
    return entries


def assert_prefilled_line(stack: Stack, entries: list[dict[str, Any]], request_id: str) -> None:
    """The request's one line, with the fields an operator follows a P/D request by."""
    (line,) = [e for e in entries if e.get("request_id") == request_id]
    assert line["level"] == "info"
    assert line["msg"] == "pd request prefilled"
    assert line["transfer_id"].startswith("xfer-")
    assert line["prefill_target"] == str(stack.sim.prefill)
    assert line["dp_rank"] in (0, 1)
    assert line["prefill_outcome"] == "2xx"
    assert line["prefill_ms"] > 0
