"""The processor driven through a real grpc.aio channel with scripted ProcessingRequests,
as Envoy would send them. The prefill pod is the simulator, a real HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdproc_sim import RunningPrefill

from pdproc._proto.envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import (
    ProcessingMode,
)
from pdproc.config import BootstrapPolicy
from pdproc.targets import AllowList
from tests.envoy_side import CHAT, body_msg, headers_msg, recv, response_headers_msg
from tests.waiting import eventually_async

from .harness import Harness


async def test_health_service_reports_serving(h: Harness) -> None:
    stub = health_pb2_grpc.HealthStub(h.channel)
    for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_header_only_request_passes_through_without_body(h: Harness) -> None:
    call = h.open()
    await call.write(headers_msg("/v1/models", "GET", h.target, end_of_stream=True))
    answer = await recv(call)
    assert answer.WhichOneof("response") == "request_headers"
    assert answer.mode_override.request_body_mode == ProcessingMode.NONE
    assert answer.mode_override.response_header_mode == ProcessingMode.SKIP
    removed = answer.request_headers.response.header_mutation.remove_headers
    assert list(removed) == ["x-prefiller-host-port"]
    await call.done_writing()
    assert h.sample("pdproc_requests_total", path="other", outcome="passthrough") == 1


def assert_decode_body(answer: Any, h: Harness) -> dict[str, Any]:
    """The body answer carries the decode's body, its content-length, and the decode's
    kv_transfer_params (returned)."""
    common = answer.request_body.response
    body = common.body_mutation.body
    decode = orjson.loads(body)
    (length,) = [h for h in common.header_mutation.set_headers if h.header.key == "content-length"]
    assert length.header.raw_value == str(len(body)).encode()
    assert length.header.value == ""  # raw_value only: `value` arrives empty in Envoy
    kv: dict[str, Any] = decode["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True
    assert kv["do_remote_decode"] is False
    assert kv["remote_bootstrap_addr"] == h.prefill.bootstrap_url
    assert kv["transfer_id"].startswith("xfer-")
    assert (decode["max_tokens"], decode["max_completion_tokens"]) == (50, 100)
    return kv


async def the_answered_prefill(h: Harness) -> dict[str, Any]:
    """The simulator's one record, once the prefill it records has been answered."""
    records: list[dict[str, Any]] = []

    async def prefilled() -> bool:
        records[:] = await h.prefill_records()
        return bool(records) and records[-1]["status"] is not None

    await eventually_async(prefilled)
    (record,) = records
    return record


def assert_prefill_request(record: dict[str, Any], kv: dict[str, Any], h: Harness) -> None:
    prefill_kv = record["body"]["kv_transfer_params"]
    assert prefill_kv == {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "transfer_id": kv["transfer_id"],
    }
    assert record["body"]["max_tokens"] == 1
    assert record["body"]["max_completion_tokens"] == 1
    assert record["body"]["stream"] is False
    rank = int(record["headers"]["x-data-parallel-rank"])
    assert h.prefill.engine_ids[rank] == kv["remote_engine_id"]
    assert record["headers"]["authorization"] == "Bearer t"
    assert record["headers"]["x-request-id"] == "req-1"
    assert "x-prefiller-host-port" not in record["headers"]


async def test_pd_request_rewrites_body_and_launches_prefill(h: Harness) -> None:
    call = h.open()
    await call.write(headers_msg(extra={**h.target, "authorization": "Bearer t"}))
    first = await recv(call)
    assert first.WhichOneof("response") == "request_headers"
    assert not first.HasField("mode_override")
    assert list(first.request_headers.response.header_mutation.remove_headers) == [
        "x-prefiller-host-port"
    ]

    await call.write(body_msg({**CHAT, "max_completion_tokens": 100}))
    kv = assert_decode_body(await recv(call), h)
    assert_prefill_request(await the_answered_prefill(h), kv, h)

    await call.write(response_headers_msg("200"))
    third = await recv(call)
    assert third.WhichOneof("response") == "response_headers"
    await call.done_writing()
    await eventually_async(
        lambda: h.sample("pdproc_requests_total", path="/v1/chat/completions", outcome="pd") == 1
    )


async def test_response_headers_are_held_until_the_prefill_ends(
    make_harness: Callable[..., Any],
) -> None:
    # A hold nearing Envoy's message_timeout asks Envoy to wait (here after 0.2 s).
    h: Harness = await make_harness(envoy_message_timeout=0.4)
    await h.faults(prefill_hang=True)
    call = await h.past_headers()
    await call.write(body_msg(CHAT))
    await recv(call)
    await call.write(response_headers_msg("200"))
    hold = await recv(call)
    # First the timeout extension, alone: Envoy honours only the first one per message.
    assert hold.WhichOneof("response") is None
    assert 10 <= hold.override_message_timeout.seconds <= 12
    assert h.sample("pdproc_prefills_total", outcome="2xx") == 0
    await h.faults(prefill_hang=False)
    answer = await recv(call)
    assert answer.WhichOneof("response") == "response_headers"
    assert h.sample("pdproc_prefills_total", outcome="2xx") == 1
    await call.done_writing()


async def test_a_short_hold_costs_no_extra_message(h: Harness) -> None:
    """The prefill ends well inside Envoy's message_timeout: the held response headers get
    their one answer, with no timeout override before it."""
    await h.faults(prefill_hang=True)
    call = await h.past_headers()
    await call.write(body_msg(CHAT))
    await recv(call)
    await call.write(response_headers_msg("200"))
    await h.faults(prefill_hang=False)
    answer = await recv(call)
    assert answer.WhichOneof("response") == "response_headers"
    assert not answer.HasField("override_message_timeout")
    await call.done_writing()


async def test_invalid_json_gets_400(h: Harness) -> None:
    call = await h.past_headers()
    await call.write(body_msg(b"{not json"))
    answer = await recv(call)
    immediate = answer.immediate_response
    assert immediate.status.code == 400
    error = orjson.loads(immediate.body)
    assert error["type"] == "BadRequestError"
    assert error["object"] == "error"
    assert error["code"] == 400
    content_type = {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}
    assert content_type["content-type"] == b"application/json"
    assert await h.prefill_records() == []


async def test_array_body_gets_400(h: Harness) -> None:
    call = await h.past_headers()
    await call.write(body_msg(b"[1,2,3]"))
    assert (await recv(call)).immediate_response.status.code == 400


async def test_disallowed_target_gets_403_and_no_traffic(
    make_harness: Callable[..., Any],
) -> None:
    h: Harness = await make_harness(prefill_allow=AllowList.parse(["10.0.0.0/8"]))
    call = h.open()
    await call.write(headers_msg(extra=h.target))
    answer = await recv(call)
    assert answer.immediate_response.status.code == 403
    assert b"not allowed" in answer.immediate_response.body
    async with httpx.AsyncClient() as client:
        stats = (await client.get(h.prefill.url + "/sim/stats")).json()
    assert stats["bootstrap_queries"] == 0
    assert await h.prefill_records() == []


async def test_malformed_target_header_gets_400(h: Harness) -> None:
    call = h.open()
    await call.write(headers_msg(extra={"x-prefiller-host-port": "no-port-here"}))
    assert (await recv(call)).immediate_response.status.code == 400


async def test_no_target_passes_through_unchanged(h: Harness) -> None:
    call = h.open()
    await call.write(headers_msg())
    answer = await recv(call)
    # The body is still checked (client kv_transfer_params), the response phase skipped.
    assert answer.mode_override.request_body_mode == ProcessingMode.BUFFERED
    assert answer.mode_override.response_header_mode == ProcessingMode.SKIP
    await call.write(body_msg(CHAT))
    body_answer = await recv(call)
    assert not body_answer.request_body.response.HasField("body_mutation")
    assert (
        h.sample("pdproc_requests_total", path="/v1/chat/completions", outcome="passthrough") == 1
    )


async def test_pool_member_is_used_without_header_or_allow_list(
    make_harness: Callable[..., Any], prefill: RunningPrefill
) -> None:
    from pdproc.targets import parse_host_port

    h: Harness = await make_harness(
        prefill=(parse_host_port(prefill.address),), prefill_allow=AllowList()
    )
    call = h.open()
    await call.write(headers_msg())
    await recv(call)
    await call.write(body_msg(CHAT))
    answer = await recv(call)
    kv = orjson.loads(answer.request_body.response.body_mutation.body)["kv_transfer_params"]
    assert kv["remote_bootstrap_addr"] == prefill.bootstrap_url
    await eventually_async(lambda: h.sample("pdproc_prefills_total", outcome="2xx") == 1)


async def test_huge_body_is_rewritten(h: Harness) -> None:
    prompt = "x" * (5 * 1024 * 1024)  # past grpc's 4 MiB default receive limit
    call = await h.past_headers()
    await call.write(body_msg({**CHAT, "messages": [{"role": "user", "content": prompt}]}))
    answer = await recv(call, timeout_s=30)
    body = answer.request_body.response.body_mutation.body
    assert len(body) > 5 * 1024 * 1024
    assert orjson.loads(body)["messages"][0]["content"] == prompt


async def test_body_over_limit_gets_413(make_harness: Callable[..., Any]) -> None:
    h: Harness = await make_harness(max_body_bytes=1024 * 1024)
    call = await h.past_headers()
    await call.write(body_msg({**CHAT, "prompt": "y" * (1024 * 1024 + 10)}))
    answer = await recv(call)
    assert answer.immediate_response.status.code == 413
    assert orjson.loads(answer.immediate_response.body)["code"] == 413


async def test_a_buffered_body_followed_by_trailers_gets_400(h: Harness) -> None:
    """BUFFERED sends a body without end_of_stream only when trailers follow it."""
    call = await h.past_headers()
    await call.write(body_msg(b'{"model":', end_of_stream=False))
    answer = (await recv(call)).immediate_response
    assert answer.status.code == 400
    assert b"trailers are not supported" in answer.body


async def test_a_stream_cancelled_before_the_decode_answered_cancels_its_prefill(
    h: Harness,
) -> None:
    """The client hung up before the decode answered: nobody will use the prefill's KV, so
    pdproc cancels it (the pod aborts it) and counts the request `cancelled`, not `pd`."""
    await h.faults(prefill_hang=True)
    call = await h.past_headers()
    await call.write(body_msg(CHAT))
    await recv(call)
    assert h.server.service is not None
    await eventually_async(lambda: h.sample("pdproc_prefills_in_flight") == 1)
    call.cancel()  # the client hung up; Envoy resets the stream
    await eventually_async(lambda: h.sample("pdproc_streams_active") == 0)
    await eventually_async(lambda: h.sample("pdproc_prefills_in_flight") == 0)
    assert h.sample("pdproc_prefills_total", outcome="cancelled") == 1
    assert h.sample("pdproc_requests_total", path="/v1/chat/completions", outcome="cancelled") == 1
    assert h.sample("pdproc_requests_total", path="/v1/chat/completions", outcome="pd") == 0
    assert len(h.server.service.breakers) == 0  # the client leaving is not the pod's fault
    await h.faults(prefill_hang=False)


async def test_a_stream_ended_after_the_decode_answered_leaves_the_prefill_running(
    h: Harness,
) -> None:
    """Past the decode's answer (here a 503 of its own) the prefill carries on and is
    counted when it ends: the client got its answer."""
    await h.faults(prefill_hang=True)
    call = await h.past_headers()
    await call.write(body_msg(CHAT))
    await recv(call)
    await call.write(response_headers_msg("503"))
    assert (await recv(call)).WhichOneof("response") == "response_headers"
    call.cancel()
    await eventually_async(lambda: h.sample("pdproc_streams_active") == 0)
    assert h.server.service is not None
    assert h.sample("pdproc_prefills_in_flight") == 1
    await h.faults(prefill_hang=False)
    await eventually_async(lambda: h.sample("pdproc_prefills_total", outcome="2xx") == 1)
    assert h.sample("pdproc_requests_total", path="/v1/chat/completions", outcome="pd") == 1


async def test_failed_prefill_aborts_before_response(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As if the engine map had been fetched more than a second ago (see the next test).
    monkeypatch.setattr("pdproc.engine_maps.MIN_REFETCH_S", 0.0)
    await h.faults(prefill_status=500)
    call = await h.past_headers()
    await call.write(body_msg(CHAT))
    assert (await recv(call)).WhichOneof("response") == "request_body"
    abort = await recv(call)  # unsolicited: no message of Envoy's asked for it
    assert abort.immediate_response.status.code == 502
    error = orjson.loads(abort.immediate_response.body)
    assert error["type"] == "BadGateway"
    assert "prefill failed" in error["message"]
    assert h.sample("pdproc_decode_aborts_total", when="before_response") == 1
    assert (
        h.sample("pdproc_requests_total", path="/v1/chat/completions", outcome="prefill_failed")
        == 1
    )
    # The pod may have restarted: its engine ids are asked for again next time.
    assert h.sample("pdproc_engine_cache_events_total", event="invalidation") == 1


async def test_a_fresh_engine_map_survives_a_burst_of_failures(h: Harness) -> None:
    """Failures come in bursts, and a client may aim them at a pod's other ports: a map
    fetched within the last second is kept, so the bootstrap server is asked once."""
    await h.faults(prefill_status=500)
    for _ in range(5):
        call = await h.past_headers()
        await call.write(body_msg(CHAT))
        await recv(call)
        assert (await recv(call)).immediate_response.status.code == 502
    assert h.sample("pdproc_engine_cache_events_total", event="invalidation") == 0
    async with httpx.AsyncClient() as client:
        stats = (await client.get(h.prefill.url + "/sim/stats")).json()
    assert stats["bootstrap_queries"] == 1


async def test_prefill_timeout_aborts_held_response_with_504(
    make_harness: Callable[..., Any],
) -> None:
    h: Harness = await make_harness(prefill_timeout=0.3)
    await h.faults(prefill_hang=True)
    call = await h.past_headers()
    await call.write(body_msg(CHAT))
    await recv(call)
    await call.write(response_headers_msg("200"))
    # The prefill times out long before Envoy's message_timeout: one answer, the 504.
    abort = await recv(call)
    assert abort.immediate_response.status.code == 504
    await h.faults(prefill_hang=False)


async def test_decode_error_is_passed_on_while_prefill_runs(h: Harness) -> None:
    await h.faults(prefill_hang=True)
    call = await h.past_headers()
    await call.write(body_msg(CHAT))
    await recv(call)
    await call.write(response_headers_msg("503"))
    answer = await recv(call)
    assert answer.WhichOneof("response") == "response_headers"
    await h.faults(prefill_hang=False)


@pytest.mark.parametrize("fault", ["down", "garbage", "empty"])
async def test_bootstrap_failure_gets_502(h: Harness, fault: str) -> None:
    await h.faults(bootstrap=fault)
    call = await h.past_headers()
    await call.write(body_msg(CHAT))
    answer = await recv(call)
    assert answer.immediate_response.status.code == 502
    assert orjson.loads(answer.immediate_response.body)["type"] == "BadGateway"
    assert await h.prefill_records() == []


async def test_bootstrap_failure_decode_only_policy(make_harness: Callable[..., Any]) -> None:
    h: Harness = await make_harness(on_bootstrap_error=BootstrapPolicy.DECODE_ONLY)
    await h.faults(bootstrap="garbage")
    call = await h.past_headers()
    await call.write(body_msg(CHAT))
    answer = await recv(call)
    assert not answer.request_body.response.HasField("body_mutation")  # the client's bytes
    assert answer.dynamic_metadata.fields["pdproc"].struct_value.fields["body_checked"].bool_value
    assert (
        h.sample("pdproc_requests_total", path="/v1/chat/completions", outcome="decode_only") == 1
    )


async def test_concurrent_misses_make_one_bootstrap_query(h: Harness) -> None:
    calls = [h.open() for _ in range(8)]
    for call in calls:
        await call.write(headers_msg(extra=h.target))
    for call in calls:
        await recv(call)
        await call.write(body_msg(CHAT))
    for call in calls:
        assert (await recv(call)).WhichOneof("response") == "request_body"
    async with httpx.AsyncClient() as client:
        stats = (await client.get(h.prefill.url + "/sim/stats")).json()
    assert stats["bootstrap_queries"] == 1


async def test_duplicate_end_of_stream_and_out_of_order_messages(h: Harness) -> None:
    call = h.open()
    await call.write(body_msg(CHAT))  # a body before any headers
    assert (await recv(call)).WhichOneof("response") == "request_body"
    await call.write(headers_msg(extra=h.target))
    await recv(call)
    await call.write(body_msg(CHAT))
    assert (await recv(call)).request_body.response.HasField("body_mutation")
    await call.write(body_msg(CHAT))  # a second end_of_stream
    repeat = await recv(call)
    assert repeat.WhichOneof("response") == "request_body"
    assert not repeat.request_body.response.HasField("body_mutation")


async def test_log_bodies_adds_the_prompt_only_when_asked(
    make_harness: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdproc.prefill")
    for log_bodies in (False, True):
        h: Harness = await make_harness(log_bodies=log_bodies)
        caplog.clear()
        call = h.open()
        await call.write(headers_msg(extra=h.target))
        await recv(call)
        await call.write(body_msg({**CHAT, "messages": [{"role": "user", "content": "secret"}]}))
        await recv(call)
        await eventually_async(lambda: any(r.msg == "pd request prefilled" for r in caplog.records))
        (line,) = [r for r in caplog.records if r.msg == "pd request prefilled"]
        assert ("secret" in getattr(line, "body", "")) is log_bodies


async def test_a_bug_is_answered_as_a_500_not_a_broken_stream(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert h.server.service is not None

    async def broken(*_: Any) -> Any:
        raise RuntimeError("simulated bug")

    # The one stand-in in this file: a defect cannot be produced on purpose otherwise.
    monkeypatch.setattr(h.server.service.engines, "get", broken)
    call = await h.past_headers()
    await call.write(body_msg(CHAT))
    answer = await recv(call)
    assert answer.immediate_response.status.code == 500
    assert orjson.loads(answer.immediate_response.body)["type"] == "InternalServerError"
    assert h.sample("pdproc_requests_total", path="/v1/chat/completions",
                    outcome="internal_error") == 1  # fmt: skip


@pytest.mark.parametrize("target", [True, False])
async def test_client_kv_transfer_params_are_refused(h: Harness, target: bool) -> None:
    """Whether or not pdproc disaggregates the request (no prefill target here when
    `target` is false), a client's own kv_transfer_params never reach the decode."""
    call = h.open()
    await call.write(headers_msg(extra=h.target if target else {}))
    await recv(call)
    evil = {"remote_bootstrap_addr": "http://169.254.169.254:80", "do_remote_prefill": True}
    await call.write(body_msg({**CHAT, "kv_transfer_params": evil}))
    answer = await recv(call)
    assert answer.immediate_response.status.code == 400
    assert "kv_transfer_params" in orjson.loads(answer.immediate_response.body)["message"]
    assert await h.prefill_records() == []


async def test_single_message_mode_reads_every_header_attribute(h: Harness) -> None:
    """In single-message mode the headers come as request_attributes with the body; pdproc
    takes whichever `request.headers['<name>']` the filter lists and forwards them to the
    prefill (so an operator can add, e.g., an API-key header to the list)."""
    request = body_msg(CHAT)
    attributes = request.attributes["envoy.filters.http.ext_proc"]
    attributes.update(
        {
            "request.path": "/v1/chat/completions",
            "request.method": "POST",
            "request.id": "req-attr",
            "request.headers['x-api-key']": "k-123",
            "request.headers['authorization']": "Bearer t",
        }
    )
    request.metadata_context.filter_metadata["pdproc"].update({"prefiller": h.prefill.address})
    call = h.open()
    await call.write(request)
    answer = await recv(call)
    assert answer.request_body.response.HasField("body_mutation")
    await eventually_async(lambda: h.sample("pdproc_prefills_total", outcome="2xx") == 1)
    (record,) = await h.prefill_records()
    assert record["headers"]["x-api-key"] == "k-123"
    assert record["headers"]["authorization"] == "Bearer t"
    assert record["headers"]["x-request-id"] == "req-attr"


async def test_pool_mode_leaves_short_prompts_to_the_decode(
    make_harness: Callable[..., Any], prefill: RunningPrefill
) -> None:
    """--pd-min-prompt: in pool mode a body below the bound is served by the decode alone
    (counted short_prompt); an endpoint picker's explicit choice is kept."""
    from pdproc.targets import parse_host_port

    long_chat = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
    h: Harness = await make_harness(prefill=(parse_host_port(prefill.address),), pd_min_prompt=1000)
    for body, extra, rewritten in (
        (CHAT, {}, False),
        (long_chat, {}, True),
        (CHAT, h.target, True),
    ):
        call = h.open()
        await call.write(headers_msg(extra=extra))
        await recv(call)
        await call.write(body_msg(body))
        answer = await recv(call)
        assert answer.request_body.response.HasField("body_mutation") is rewritten
        await call.write(response_headers_msg("200"))
        assert (await recv(call)).WhichOneof("response") == "response_headers"
        await call.done_writing()
    path = "/v1/chat/completions"
    assert h.sample("pdproc_requests_total", path=path, outcome="short_prompt") == 1
    await eventually_async(lambda: h.sample("pdproc_prefills_total", outcome="2xx") == 2)


async def test_a_bug_in_a_held_answer_is_a_500_not_a_timeout(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdproc import processors

    def broken(*_: Any) -> Any:
        raise RuntimeError("simulated bug")

    # A stand-in, as above: a defect in the deferred path cannot be produced otherwise.
    monkeypatch.setattr(processors.ConcurrentPair, "_settled", broken)
    await h.faults(prefill_hang=True)
    call = await h.past_headers()
    await call.write(body_msg(CHAT))
    await recv(call)
    await call.write(response_headers_msg("200"))
    await h.faults(prefill_hang=False)
    answer = await recv(call)
    assert answer.immediate_response.status.code == 500
    assert orjson.loads(answer.immediate_response.body)["type"] == "InternalServerError"
    # Still exactly one outcome for the request (its prefill's, counted first).
    await eventually_async(lambda: h.sample("pdproc_requests_total") == 1)
