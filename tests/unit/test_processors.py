"""Each processor alone, with fake dependencies (tests/unit/fakes.py) and the real, pure
connectors: what it answers at each phase, what it launches, and the one outcome its
request is counted as, at whatever point the request ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from pdproc import extproc_messages as msg
from pdproc.config import BootstrapPolicy
from pdproc.connectors.mooncake import Mooncake
from pdproc.connectors.nixlv2 import NixlV2
from pdproc.connectors.sglang import SGLang
from pdproc.engine_maps import BootstrapError
from pdproc.errors import ErrorKind, ErrorReply
from pdproc.outcomes import Outcome, PrefillResult
from pdproc.pod_verdict import Verdict
from pdproc.prefill import PrefillOutcome
from pdproc.processors import (
    ConcurrentPair,
    DecodeOnly,
    Deferred,
    PassThrough,
    Rejected,
    SequentialPair,
    checked_body,
    prefill_error,
)
from pdproc.targets import HostPort

from .fakes import (
    CHAT,
    CHAT_BYTES,
    POD,
    World,
    body,
    recording_span,
    response_headers,
    settle,
    wire,
)

KV = "kv_transfer_params"


@pytest.fixture
async def world() -> AsyncIterator[World]:
    w = World()
    yield w
    await w.launcher.close()


def concurrent(w: World, connector: Any = None, **kw: Any) -> ConcurrentPair:
    return ConcurrentPair(
        kw.pop("context", None) or w.context(),
        w.deps,
        connector or Mooncake(8998),
        POD,
        w.abort,
        **kw,
    )


def sequential(w: World, **kw: Any) -> SequentialPair:
    return SequentialPair(kw.pop("context", None) or w.context(), w.deps, NixlV2(), POD, **kw)


def status(answer: Any) -> int:
    assert isinstance(answer, msg.Answer)
    assert answer.HasField("immediate_response")
    return int(answer.immediate_response.status.code)


def rewritten(answer: Any) -> dict[str, Any]:
    assert isinstance(answer, msg.Answer)
    data: dict[str, Any] = orjson.loads(wire(answer).request_body.response.body_mutation.body)
    return data


def nixl_answer(**params: Any) -> bytes:
    kv = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e1",
        "remote_request_id": "r1",
        "remote_block_ids": [1, 2],
        "remote_host": POD.host,
        "remote_port": 5600,
        **params,
    }
    return orjson.dumps({"id": "x", KV: kv})


# --- the request's context -------------------------------------------------------------


def test_the_first_outcome_is_the_one_counted(world: World) -> None:
    context = world.context()
    context.finish(Outcome.PD)
    context.finish(Outcome.ABANDONED)
    assert context.finished
    assert world.counted.outcomes == [("/v1/chat/completions", Outcome.PD)]


def test_a_replaced_request_id_goes_on_the_decode_only_while_headers_are_held(
    world: World,
) -> None:
    assert world.context(id_replaced=True).held_request_id() == "req-1"
    assert world.context(id_replaced=True, single_message=True).held_request_id() is None
    assert world.context().held_request_id() is None


def test_the_span_carries_the_outcome_and_is_ended_on_close(world: World) -> None:
    span = recording_span()
    context = world.context(span=span)
    answer = context.reject(ErrorReply(ErrorKind.FORBIDDEN, "no"))
    assert status(answer) == 403
    assert span.attributes is not None
    assert span.attributes["pdproc.outcome"] == "forbidden"
    context.close()
    assert not span.is_recording()


# --- not disaggregated -----------------------------------------------------------------


async def test_pass_through_is_counted_at_once_and_lets_everything_by(world: World) -> None:
    processor = PassThrough(world.context())
    assert world.counted.only is Outcome.PASSTHROUGH
    assert await processor.request_headers() is msg.PASS_THROUGH_HEADERS
    assert await processor.request_body(body()) is msg.CONTINUE_REQUEST_BODY
    assert processor.request_trailers() is msg.CONTINUE_REQUEST_TRAILERS
    assert processor.response_headers(response_headers()) is msg.CONTINUE_RESPONSE_HEADERS
    assert processor.close(abandoned=False) is None
    assert processor.close(abandoned=True) is Outcome.ABANDONED


async def test_rejected_answers_its_error_at_headers_or_body(world: World) -> None:
    reply = ErrorReply(ErrorKind.PREFILL_UNAVAILABLE, "circuit open")
    assert status(await Rejected(world.context(), reply).request_headers()) == 503
    assert status(await Rejected(world.context(), reply).request_body(body())) == 503
    assert [o for _, o in world.counted.outcomes] == [Outcome.PREFILL_UNAVAILABLE] * 2


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        # BUFFERED: a body not marked as the end is followed by trailers, which are refused.
        (body(end_of_stream=False), ErrorKind.BAD_REQUEST),
        (body(b"{" + b" " * 100 + b"}"), ErrorKind.TOO_LARGE),
        (body(b"[1]"), ErrorKind.BAD_REQUEST),
    ],
)
def test_body_checks(world: World, message: Any, kind: ErrorKind) -> None:
    checked = checked_body(world.context(), message, max_bytes=64)
    assert isinstance(checked, ErrorReply)
    assert checked.kind is kind


async def test_decode_only_checks_the_body_and_serves_it_alone(world: World) -> None:
    processor = DecodeOnly(world.context(), world.deps, Outcome.DECODE_ONLY, "pod down")
    assert await processor.request_headers() is msg.CHECK_BODY_ONLY_HEADERS
    answer = await processor.request_body(body())
    assert answer is msg.CHECKED_REQUEST_BODY
    assert world.counted.only is Outcome.DECODE_ONLY
    assert world.budget.held == 0


async def test_decode_only_refuses_client_transfer_fields(world: World) -> None:
    processor = DecodeOnly(world.context(), world.deps, Outcome.PASSTHROUGH)
    raw = orjson.dumps({**CHAT, KV: {"remote_host": "evil"}})
    assert status(await processor.request_body(body(raw))) == 400
    assert world.counted.only is Outcome.BAD_REQUEST


async def test_decode_only_over_the_byte_budget_is_overloaded(world: World) -> None:
    world.budget.take(world.budget.limit)
    processor = DecodeOnly(world.context(), world.deps, Outcome.PASSTHROUGH)
    assert status(await processor.request_body(body())) == 503
    assert world.counted.only is Outcome.OVERLOADED


# --- the concurrent pair (Mooncake, SGLang) --------------------------------------------


async def test_mooncake_pair_launches_both_legs_and_counts_pd_once_both_answered(
    world: World,
) -> None:
    span = recording_span()
    processor = concurrent(world, context=world.context(span=span))
    assert await processor.request_headers() is msg.CONTINUE_REQUEST_HEADERS
    assert world.engines.prefetched == [POD]
    decode = rewritten(await processor.request_body(body()))
    job = world.launcher.job
    assert_one_transfer_on_both_legs(decode, job, span)
    assert world.counted.outcomes == []
    await settle(job, PrefillResult.OK, status=200)
    assert world.counted.outcomes == []  # the decode has not answered yet
    assert processor.response_headers(response_headers("200")) is msg.CONTINUE_RESPONSE_HEADERS
    assert world.counted.only is Outcome.PD
    assert processor.close(abandoned=False) is None


def assert_one_transfer_on_both_legs(decode: dict[str, Any], job: Any, span: Any) -> None:
    """The decode pulls what the prefill pushes: one transfer, named on both legs, from
    engine 0's rank (on the prefill's headers and the span)."""
    prefill = orjson.loads(bytes(job.legs.prefill_body))
    assert decode[KV]["transfer_id"] == prefill[KV]["transfer_id"]
    assert decode[KV]["remote_engine_id"] == "engine-0"
    assert job.legs.prefill_headers == {"x-data-parallel-rank": "0"}
    assert span.attributes is not None
    assert span.attributes["pdproc.dp_rank"] == 0


async def test_sglang_pair_sends_both_legs_the_same_room(world: World) -> None:
    processor = concurrent(world, SGLang(8998))
    assert await processor.request_headers() is msg.CONTINUE_REQUEST_HEADERS
    assert world.engines.prefetched == []  # SGLang needs no engine map
    decode = rewritten(await processor.request_body(body()))
    prefill = orjson.loads(bytes(world.launcher.job.legs.prefill_body))
    assert decode == prefill
    assert decode["bootstrap_host"] == POD.host


async def test_a_decode_answered_before_its_prefill_waits_for_it(world: World) -> None:
    processor = concurrent(world)
    await processor.request_body(body())
    deferred = processor.response_headers(response_headers("200"))
    assert isinstance(deferred, Deferred)
    await settle(world.launcher.job, PrefillResult.OK, status=200)
    assert await deferred.later is msg.CONTINUE_RESPONSE_HEADERS
    assert world.counted.only is Outcome.PD


async def test_a_prefill_failing_while_the_decode_is_held_aborts_it(world: World) -> None:
    processor = concurrent(world)
    await processor.request_body(body())
    deferred = processor.response_headers(response_headers("200"))
    assert isinstance(deferred, Deferred)
    await settle(world.launcher.job, PrefillResult.TIMEOUT, error="slow")
    assert status(await deferred.later) == 504
    assert world.counted.only is Outcome.PREFILL_TIMEOUT
    assert world.aborts == []  # the held answer is the abort


async def test_a_prefill_failing_before_the_decode_answers_aborts_at_once(world: World) -> None:
    processor = concurrent(world)
    await processor.request_body(body())
    await settle(world.launcher.job, PrefillResult.SERVER_ERROR, status=500, error="status 500")
    assert [status(a) for a in world.aborts] == [502]
    assert world.counted.only is Outcome.PREFILL_FAILED
    # The decode's answer, if it still comes, is answered with the same error.
    assert status(processor.response_headers(response_headers("200"))) == 502


async def test_a_prefill_failing_after_the_decode_failed_is_counted_not_aborted(
    world: World,
) -> None:
    processor = concurrent(world)
    await processor.request_body(body())
    answer = processor.response_headers(response_headers("503"))
    assert answer is msg.CONTINUE_RESPONSE_HEADERS  # the client sees the decode's own error
    assert processor.close(abandoned=False) is None  # the prefill's outcome is still to come
    await settle(world.launcher.job, PrefillResult.CONNECT_ERROR, error="refused")
    assert world.counted.only is Outcome.PREFILL_FAILED
    assert world.aborts == []


async def test_a_prefill_succeeding_after_the_decode_failed_counts_pd(world: World) -> None:
    processor = concurrent(world)
    await processor.request_body(body())
    processor.response_headers(response_headers("404"))
    await settle(world.launcher.job, PrefillResult.OK, status=200)
    assert world.counted.only is Outcome.PD


async def test_a_decode_5xx_drops_the_pods_engine_map(world: World) -> None:
    processor = concurrent(world)
    await processor.request_body(body())
    processor.response_headers(response_headers("502"))
    assert world.engines.invalidated == [POD]


async def test_the_client_leaving_cancels_a_running_prefill(world: World) -> None:
    processor = concurrent(world)
    await processor.request_body(body())
    await asyncio.sleep(0)  # the exchange with the pod has begun
    assert processor.close(abandoned=True) is Outcome.CANCELLED
    job = world.launcher.job
    assert job.task is not None
    await world.launcher.close()
    assert job.outcome.result().outcome is PrefillResult.CANCELLED


async def test_the_client_leaving_before_the_body_is_abandoned(world: World) -> None:
    processor = concurrent(world)
    await processor.request_headers()
    assert processor.close(abandoned=True) is Outcome.ABANDONED
    assert world.launcher.jobs == []


async def test_the_client_leaving_after_its_prefill_ended_is_abandoned(world: World) -> None:
    processor = concurrent(world)
    await processor.request_body(body())
    await settle(world.launcher.job, PrefillResult.OK, status=200)
    assert processor.close(abandoned=True) is Outcome.ABANDONED


async def test_an_outcome_already_known_is_not_replaced_on_close(world: World) -> None:
    processor = concurrent(world)
    await processor.request_body(body(b"[]"))
    assert processor.close(abandoned=True) is None
    assert world.counted.only is Outcome.BAD_REQUEST


async def test_a_short_prompt_is_served_by_the_decode_alone(world: World) -> None:
    processor = concurrent(world, min_prompt=len(CHAT_BYTES) + 1)
    assert await processor.request_body(body()) is msg.CHECKED_REQUEST_BODY
    assert world.counted.only is Outcome.SHORT_PROMPT
    assert world.launcher.jobs == []
    assert processor.response_headers(response_headers()) is msg.CONTINUE_RESPONSE_HEADERS


async def test_the_pair_checks_the_body_and_the_byte_budget(world: World) -> None:
    assert status(await concurrent(world).request_body(body(b"nope"))) == 400
    world.budget.take(world.budget.limit)
    assert status(await concurrent(world).request_body(body())) == 503
    assert [o for _, o in world.counted.outcomes] == [Outcome.BAD_REQUEST, Outcome.OVERLOADED]
    assert world.launcher.jobs == []


async def test_a_body_no_leg_can_carry_is_the_clients_400(world: World) -> None:
    # Accepted by the checks, but nested past what the prefill leg can be written with.
    deep = b'{"model":"m","x":' + b"[" * 300 + b"]" * 300 + b"}"
    assert status(await concurrent(world).request_body(body(deep))) == 400
    assert world.launcher.jobs == []


@pytest.mark.parametrize(
    ("error", "outcome", "breaker"),
    [
        (BootstrapError("refused", Verdict.DOWN), Outcome.BOOTSTRAP_ERROR, Verdict.DOWN),
        (BootstrapError("status 500"), Outcome.BOOTSTRAP_ERROR, Verdict.FAILED),
        (BootstrapError("EMFILE", Verdict.NOT_THE_POD), Outcome.OVERLOADED, None),
    ],
)
async def test_a_bootstrap_failure_rejects_the_request(
    world: World, error: BootstrapError, outcome: Outcome, breaker: Verdict | None
) -> None:
    world.engines.error = error
    answer = await concurrent(world).request_body(body())
    assert status(answer) in (502, 503)
    assert world.counted.only is outcome
    assert world.pod_failures == ([] if breaker is None else [(POD, breaker)])
    assert world.launcher.jobs == []


OTHER = HostPort("10.0.0.8", 8000)
THIRD = HostPort("10.0.0.9", 8000)


async def test_a_pool_request_whose_bootstrap_fails_moves_to_another_member(
    world: World,
) -> None:
    world.pool = [POD, OTHER]
    world.engines.errors[POD] = BootstrapError("timed out", Verdict.DOWN)
    answer = await concurrent(world, from_pool=True).request_body(body())
    assert rewritten(answer)["kv_transfer_params"]["do_remote_prefill"] is True
    assert world.launcher.job.target == OTHER
    assert world.pod_failures == [(POD, Verdict.DOWN)]  # held against the pod that failed
    assert world.metrics.reroutes._value.get() == 1


async def test_tries_are_bounded_and_the_last_failure_is_the_answer(world: World) -> None:
    fourth = HostPort("10.0.0.10", 8000)
    world.pool = [POD, OTHER, THIRD, fourth]
    world.engines.error = BootstrapError("status 500")
    answer = await concurrent(world, from_pool=True).request_body(body())
    assert status(answer) == 502
    assert world.engines.asked == [POD, OTHER, THIRD]
    assert world.launcher.jobs == []


async def test_the_endpoint_pickers_choice_is_never_moved(world: World) -> None:
    world.pool = [POD, OTHER]
    world.engines.errors[POD] = BootstrapError("status 500")
    assert status(await concurrent(world).request_body(body())) == 502
    assert world.engines.asked == [POD]


async def test_a_request_counts_against_its_pod_until_its_prefill_runs(world: World) -> None:
    pair = concurrent(world, from_pool=True)
    assert world.deps.load(POD) == 1  # assigned: waiting for its body
    await pair.request_body(body())
    assert world.deps.load(POD) == 1  # now the launcher's count
    await settle(world.launcher.job, PrefillResult.OK)
    assert world.deps.load(POD) == 0
    other = concurrent(world)
    other.close(abandoned=True)
    assert world.deps.load(POD) == 0


async def test_a_bootstrap_failure_with_decode_only_policy_is_served_alone() -> None:
    world = World(on_bootstrap_error=BootstrapPolicy.DECODE_ONLY)
    world.engines.error = BootstrapError("status 500")
    assert await concurrent(world).request_body(body()) is msg.CHECKED_REQUEST_BODY
    assert world.counted.only is Outcome.DECODE_ONLY


async def test_logged_bodies_carry_an_excerpt() -> None:
    world = World(log_bodies=True)
    await concurrent(world).request_body(body())
    assert world.launcher.job.log_fields["body"] == CHAT_BYTES.decode()
    await world.launcher.close()


# --- the concurrent pair, its body streamed ----------------------------------------------

LARGE = orjson.dumps({**CHAT, "messages": [{"role": "user", "content": "p" * 200}]})


def streaming_world(**settings: Any) -> World:
    return World(stream_body_bytes=64, **settings)


def streamed(w: World, raw: bytes = LARGE, **kw: Any) -> ConcurrentPair:
    headers = {"content-length": str(len(raw))}
    return concurrent(w, context=w.context(headers, span=kw.pop("span", None)), **kw)


def chunks(raw: bytes = LARGE) -> list[Any]:
    middle = len(raw) // 2
    return [body(raw[:middle], end_of_stream=False), body(raw[middle:])]


async def test_a_large_body_streams_on_and_its_tail_carries_the_decode_fields() -> None:
    world = streaming_world()
    span = recording_span()
    processor = streamed(world, span=span)
    assert await processor.request_headers() is msg.STREAMED_HEADERS
    first, last = chunks()
    on = await processor.request_body(first)
    assert on is msg.CONTINUE_REQUEST_BODY  # the head goes on unchanged
    assert world.budget.held == len(first.body)
    tail = await processor.request_body(last)
    assert isinstance(tail, msg.Answer)
    # The last chunk is replaced by the held-back bytes, the decode's fields spliced in.
    decode = orjson.loads(first.body + wire(tail).request_body.response.body_mutation.body)
    assert (
        decode[KV]["transfer_id"]
        == orjson.loads(bytes(world.launcher.job.legs.prefill_body))[KV]["transfer_id"]
    )
    assert world.budget.held == 0
    assert span.attributes is not None
    assert span.attributes["pdproc.body_streamed"] is True
    await settle(world.launcher.job, PrefillResult.OK, status=200)
    processor.response_headers(response_headers("200"))
    assert world.counted.only is Outcome.PD
    await world.launcher.close()


@pytest.mark.parametrize(
    ("headers", "single_message"),
    [
        ({}, False),  # no content-length
        ({"content-length": "50"}, False),  # below --stream-body-bytes
        ({"content-length": str(1 << 30)}, False),  # past --max-body-bytes: buffered
        ({"content-length": str(len(LARGE))}, True),  # no headers answer to switch modes in
    ],
)
async def test_what_is_not_streamed(headers: dict[str, str], single_message: bool) -> None:
    world = streaming_world()
    context = world.context(headers, single_message=single_message)
    processor = concurrent(world, context=context)
    assert await processor.request_headers() is msg.CONTINUE_REQUEST_HEADERS


async def test_nothing_streams_with_streaming_off() -> None:
    world = World(stream_body_bytes=0)
    assert await streamed(world).request_headers() is msg.CONTINUE_REQUEST_HEADERS


async def test_a_body_stays_counted_until_the_prefill_pod_has_it() -> None:
    """The prefill body is views of the client's body: a pod slow to read it keeps it
    counted against --max-inflight-bytes, so the budget bounds what pdproc really holds."""
    world = streaming_world()
    world.launcher.sends_at_once = False
    processor = streamed(world)
    assert await processor.request_headers() is msg.STREAMED_HEADERS
    first, last = chunks()
    await processor.request_body(first)
    assert isinstance(await processor.request_body(last), msg.Answer)
    assert world.budget.held == len(first.body) + len(last.body)  # sent on, not to the pod
    sent = world.launcher.job.body_sent
    assert sent is not None
    sent.set_result(None)
    await asyncio.sleep(0)  # its callbacks run
    assert world.budget.held == 0


async def test_a_buffered_body_stays_counted_until_the_prefill_pod_has_it(world: World) -> None:
    world.launcher.sends_at_once = False
    answer = await concurrent(world).request_body(body())
    assert isinstance(answer, msg.Answer)
    assert world.budget.held == len(CHAT_BYTES)
    sent = world.launcher.job.body_sent
    assert sent is not None
    sent.set_result(None)
    await asyncio.sleep(0)
    assert world.budget.held == 0


async def test_a_full_budget_refuses_a_streamed_body_at_its_headers() -> None:
    world = streaming_world()
    world.budget.take(world.budget.limit)
    assert status(await streamed(world).request_headers()) == 503
    assert world.counted.only is Outcome.OVERLOADED


async def test_a_chunk_past_the_budget_is_refused_and_its_bytes_released() -> None:
    first, last = chunks()
    world = streaming_world(max_inflight_bytes=len(first.body) + 20)
    processor = streamed(world)
    await processor.request_headers()
    assert world.budget.take(20)  # another request's bytes
    assert await processor.request_body(first) is msg.CONTINUE_REQUEST_BODY
    assert status(await processor.request_body(last)) == 503
    assert world.budget.held == 20
    assert world.counted.only is Outcome.OVERLOADED


async def test_a_streamed_body_longer_than_announced_is_a_400() -> None:
    world = streaming_world()
    processor = streamed(world)
    await processor.request_headers()
    assert status(await processor.request_body(body(LARGE + b" " * 10))) == 400
    assert world.budget.held == 0


async def test_a_streamed_body_that_is_not_json_is_refused_at_its_end() -> None:
    world = streaming_world()
    raw = b"x" * len(LARGE)
    processor = streamed(world, raw)
    await processor.request_headers()
    first, last = chunks(raw)
    await processor.request_body(first)
    assert status(await processor.request_body(last)) == 400
    assert world.launcher.jobs == []


async def test_trailers_after_a_streamed_body_are_refused() -> None:
    world = streaming_world()
    processor = streamed(world)
    await processor.request_headers()
    await processor.request_body(chunks()[0])
    assert status(processor.request_trailers()) == 400
    assert world.budget.held == 0
    assert world.counted.only is Outcome.BAD_REQUEST


@pytest.mark.parametrize(("code", "outcome"), [("413", Outcome.TOO_LARGE), ("200", None)])
async def test_an_answer_to_a_streamed_body_never_released(
    code: str, outcome: Outcome | None
) -> None:
    world = streaming_world()
    processor = streamed(world)
    await processor.request_headers()
    await processor.request_body(chunks()[0])
    answer = processor.response_headers(response_headers(code))
    assert answer is msg.CONTINUE_RESPONSE_HEADERS
    assert world.counted.only is (outcome or Outcome.UNFINISHED_BODY)
    assert world.budget.held == 0


async def test_a_streamed_body_with_decode_only_policy_ends_without_fields() -> None:
    world = streaming_world(on_bootstrap_error=BootstrapPolicy.DECODE_ONLY)
    world.engines.error = BootstrapError("status 500")
    processor = streamed(world)
    await processor.request_headers()
    first, last = chunks()
    await processor.request_body(first)
    tail = await processor.request_body(last)
    assert isinstance(tail, msg.Answer)
    assert wire(tail).request_body.response.body_mutation.body == last.body  # no fields spliced
    assert world.counted.only is Outcome.DECODE_ONLY


# --- the sequential pair (NIXL v2) -------------------------------------------------------


async def test_nixl_decode_is_built_from_the_prefills_answer(world: World) -> None:
    processor = sequential(world, context=world.context({"content-length": "100000"}))
    # Never streamed: the decode leg needs the prefill's answer first.
    assert await processor.request_headers() is msg.CONTINUE_REQUEST_HEADERS
    deferred = await processor.request_body(body())
    assert isinstance(deferred, Deferred)
    job = world.launcher.job
    assert job.keep_answer
    assert orjson.loads(bytes(job.legs.prefill_body))["max_tokens"] == 1
    await settle(job, PrefillResult.OK, status=200, answer=nixl_answer())
    decode = rewritten(await deferred.later)
    assert decode[KV]["remote_engine_id"] == "e1"
    assert decode["max_tokens"] == CHAT["max_tokens"]
    assert processor.request_trailers() is msg.CONTINUE_REQUEST_TRAILERS
    assert processor.response_headers(response_headers("200")) is msg.CONTINUE_RESPONSE_HEADERS
    assert world.counted.only is Outcome.PD


async def test_nixl_answer_without_kv_params_is_served_alone(world: World) -> None:
    deferred = await sequential(world).request_body(body())
    assert isinstance(deferred, Deferred)
    empty = b'{"kv_transfer_params":null}'
    await settle(world.launcher.job, PrefillResult.OK, status=200, answer=empty)
    assert await deferred.later is msg.CHECKED_REQUEST_BODY
    assert world.counted.only is Outcome.DECODE_ONLY


async def test_nixl_answer_naming_a_foreign_side_channel_is_refused(world: World) -> None:
    processor = sequential(world)
    deferred = await processor.request_body(body())
    assert isinstance(deferred, Deferred)
    answer = nixl_answer(remote_host="10.9.9.9")
    await settle(world.launcher.job, PrefillResult.OK, status=200, answer=answer)
    assert await deferred.later is msg.CHECKED_REQUEST_BODY
    assert world.counted.only is Outcome.PREFILL_ANSWER_REFUSED
    # Served alone: the decode's answer adds nothing.
    processor.response_headers(response_headers("200"))
    assert world.counted.only is Outcome.PREFILL_ANSWER_REFUSED


async def test_nixl_side_channel_the_gateway_admits_is_used(world: World) -> None:
    from pdproc.targets import HostPort

    world.admitted.add(HostPort("10.9.9.9", 5600))
    deferred = await sequential(world).request_body(body())
    assert isinstance(deferred, Deferred)
    answer = nixl_answer(remote_host="10.9.9.9")
    await settle(world.launcher.job, PrefillResult.OK, status=200, answer=answer)
    assert rewritten(await deferred.later)[KV]["remote_host"] == "10.9.9.9"


async def test_nixl_prefill_refusing_the_request_answers_its_status_and_message(
    world: World,
) -> None:
    deferred = await sequential(world).request_body(body())
    assert isinstance(deferred, Deferred)
    refusal = b'{"error":"context too long"}'
    await settle(
        world.launcher.job,
        PrefillResult.CLIENT_ERROR,
        status=400,
        error="status 400",
        answer=refusal,
        content_type="application/json",
    )
    answer = await deferred.later
    assert status(answer) == 400
    error = orjson.loads(answer.immediate_response.body)
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert "'context too long'" in error["message"]
    assert world.counted.only is Outcome.PREFILL_FAILED


@pytest.mark.parametrize(
    ("result", "kw"),
    [
        (PrefillResult.SERVER_ERROR, {"status": 500, "error": "status 500"}),
        (PrefillResult.TIMEOUT, {"error": "slow"}),
        # A 2xx without a body to read: unusable all the same.
        (PrefillResult.OK, {"status": 200}),
    ],
)
async def test_nixl_prefill_failing_otherwise_lets_the_decode_serve_alone(
    world: World, result: PrefillResult, kw: dict[str, Any]
) -> None:
    processor = sequential(world)
    deferred = await processor.request_body(body())
    assert isinstance(deferred, Deferred)
    await settle(world.launcher.job, result, **kw)
    assert await deferred.later is msg.CHECKED_REQUEST_BODY
    assert world.counted.only is Outcome.DECODE_ONLY
    processor.response_headers(response_headers("200"))
    assert world.counted.only is Outcome.DECODE_ONLY


async def test_nixl_decode_answering_while_the_prefill_runs_counts_nothing_yet(
    world: World,
) -> None:
    processor = sequential(world)
    deferred = await processor.request_body(body())
    assert isinstance(deferred, Deferred)
    assert processor.response_headers(response_headers("500")) is msg.CONTINUE_RESPONSE_HEADERS
    assert world.counted.outcomes == []
    assert world.engines.invalidated == [POD]
    deferred.later.close()  # type: ignore[attr-defined]  # its writer never came


async def test_the_wait_for_a_prefill_asks_envoy_for_the_prefills_time(world: World) -> None:
    deferred = await sequential(world).request_body(body())
    assert isinstance(deferred, Deferred)
    hold = deferred.hold().override_message_timeout  # made when it is sent: the rest from then
    assert 59 <= hold.seconds <= 61  # the rest of the 60 s prefill timeout, plus a second
    assert deferred.hold_after == world.settings.envoy_message_timeout - 2.0
    await settle(world.launcher.job, PrefillResult.TIMEOUT, error="slow")
    await deferred.later


def test_prefill_errors_are_named_for_the_client() -> None:
    def reply(result: PrefillResult) -> ErrorReply:
        return prefill_error(PrefillOutcome(result, 1.0, error="x"))

    assert reply(PrefillResult.EXHAUSTED).kind is ErrorKind.OVERLOADED
    assert reply(PrefillResult.TIMEOUT).kind is ErrorKind.PREFILL_TIMEOUT
    assert reply(PrefillResult.CONNECT_ERROR).kind is ErrorKind.PREFILL_FAILED


async def test_trailers_with_no_body_before_them_are_refused(world: World) -> None:
    assert status(concurrent(world).request_trailers()) == 400
    assert [o for _, o in world.counted.outcomes] == [Outcome.BAD_REQUEST]


async def test_what_comes_around_a_buffered_body_passes(world: World) -> None:
    nixl = sequential(world, min_prompt=len(CHAT_BYTES) + 1)
    await nixl.request_body(body())
    # Served alone (short prompt): no prefill to wait for.
    assert nixl.response_headers(response_headers("200")) is msg.CONTINUE_RESPONSE_HEADERS
    nixl.context.close()  # no span: nothing to end
    assert [o for _, o in world.counted.outcomes] == [Outcome.SHORT_PROMPT]
