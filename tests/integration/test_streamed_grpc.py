"""Streamed request bodies (--stream-body-bytes) through a real grpc.aio channel to a real
Server, with the simulated prefill pod, as Envoy would send them in STREAMED mode: the
headers answer switches the body mode, each chunk is answered at once and only the end of
the body is rewritten."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import orjson
import pytest
from pdproc_sim import PrefillConfig, RunningPrefill, start_prefill

from pdproc._proto.envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import (
    ProcessingMode,
)
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc.config import BootstrapPolicy, KvConnector
from pdproc.request_body import members
from pdproc.streamed_body import TAIL
from tests.envoy_side import CHAT, body_msg, headers_msg, recv, response_headers_msg
from tests.waiting import eventually_async

from .harness import Harness

PATH = "/v1/chat/completions"
KiB = 1024
STREAMED = "pdproc_streamed_request_bodies_total"
IN_FLIGHT = "pdproc_request_body_bytes_in_flight"


@pytest.fixture
async def prefill() -> AsyncIterator[RunningPrefill]:
    running = await start_prefill(PrefillConfig(dp_ranks=2, prefill_delay_ms=20))
    yield running
    await running.close()


def large_chat(prompt_bytes: int = 300 * KiB, **extra: Any) -> tuple[dict[str, Any], bytes]:
    """A chat request with a long prompt, extra fields first (so they stream past early)."""
    body = {
        **extra,
        **CHAT,
        "messages": [{"role": "user", "content": "p" * prompt_bytes}],
    }
    return body, orjson.dumps(body)


def split(raw: bytes, sizes: list[int]) -> list[bytes]:
    """`raw` cut into chunks of these sizes, the rest in a last chunk."""
    chunks, at = [], 0
    for size in sizes:
        chunks.append(raw[at : at + size])
        at += size
    chunks.append(raw[at:])
    return chunks


def length_header(length: int) -> dict[str, str]:
    return {"content-length": str(length)}


def decode_bytes(chunk: bytes, answer: pb.ProcessingResponse) -> bytes:
    """What Envoy sends on to the decode for one chunk, given pdproc's answer to it."""
    assert answer.WhichOneof("response") == "request_body"
    common = answer.request_body.response
    if not common.HasField("body_mutation"):
        return chunk
    mutation = common.body_mutation
    if mutation.WhichOneof("mutation") == "clear_body":
        assert mutation.clear_body
        return b""
    return bytes(mutation.body)


def checked_mark(answer: pb.ProcessingResponse) -> bool | None:
    """The body_checked mark of an answer (None: no mark at all)."""
    if not answer.HasField("dynamic_metadata"):
        return None
    fields = answer.dynamic_metadata.fields
    if "pdproc" not in fields:
        return None
    return bool(fields["pdproc"].struct_value.fields["body_checked"].bool_value)


async def send_chunks(
    call: Any, chunks: list[bytes], *, end: bool = True
) -> list[pb.ProcessingResponse]:
    """Send the chunks one at a time (the last ends the stream unless `end` is false), each
    after the previous one's answer, as Envoy does; stop at an immediate response."""
    answers = []
    for i, chunk in enumerate(chunks):
        await call.write(body_msg(chunk, end_of_stream=end and i == len(chunks) - 1))
        answer = await recv(call)
        answers.append(answer)
        if answer.HasField("immediate_response"):
            break
    return answers


async def streamed_call(h: Harness, length: int, **extra: str) -> tuple[Any, pb.ProcessingResponse]:
    call = h.open()
    await call.write(headers_msg(extra={**h.target, **length_header(length), **extra}))
    return call, await recv(call)


def assert_streamed_headers(answer: pb.ProcessingResponse) -> None:
    assert answer.WhichOneof("response") == "request_headers"
    assert answer.mode_override.request_body_mode == ProcessingMode.STREAMED
    assert answer.mode_override.response_header_mode == ProcessingMode.SEND
    removed = set(answer.request_headers.response.header_mutation.remove_headers)
    assert removed == {"x-prefiller-host-port", "content-length"}
    assert not answer.request_headers.response.header_mutation.set_headers
    # Not marked checked (no dynamic metadata at all): only the last chunk's answer is.
    assert not answer.HasField("dynamic_metadata")


def assert_buffered_headers(answer: pb.ProcessingResponse) -> None:
    assert answer.WhichOneof("response") == "request_headers"
    assert not answer.HasField("mode_override")
    removed = list(answer.request_headers.response.header_mutation.remove_headers)
    assert removed == ["x-prefiller-host-port"]


async def finished_prefills(h: Harness, count: int) -> list[dict[str, Any]]:
    """The simulator's records once `count` prefills have been answered."""
    records: list[dict[str, Any]] = []

    async def answered() -> bool:
        records[:] = await h.prefill_records()
        return len(records) >= count and all(r["status"] is not None for r in records)

    await eventually_async(answered)
    return records


def rejection(answer: pb.ProcessingResponse) -> tuple[int, str]:
    immediate = answer.immediate_response
    return immediate.status.code, str(orjson.loads(immediate.body)["message"])


# --- (a) a large body streams past, only its end rewritten --------------------------------


def chunk_sizes(sizes: list[int] | str, length: int) -> list[int]:
    """The named cuts of a body of `length` bytes as chunk sizes."""
    if sizes == "crossing":
        return [128 * KiB, length - 128 * KiB - 5]
    if sizes == "inside":
        return [128 * KiB, length - 128 * KiB - 10, 4]
    assert isinstance(sizes, list)
    return sizes


def assert_only_the_tail_held(
    chunks: list[bytes], answers: list[pb.ProcessingResponse], length: int
) -> None:
    """Every chunk before the last is unmarked; one wholly before the tail is passed on
    untouched, one reaching into it is cut short or cleared."""
    released = 0
    for chunk, answer in zip(chunks[:-1], answers[:-1], strict=True):
        assert checked_mark(answer) is None
        if released + len(chunk) <= length - TAIL:
            assert answer == pb.ProcessingResponse(request_body=pb.BodyResponse())  # continue
        else:
            assert answer.request_body.response.HasField("body_mutation")
        released += len(chunk)


def assert_rewritten_tail(
    raw: bytes, chunks: list[bytes], answers: list[pb.ProcessingResponse], original: Any
) -> dict[str, Any]:
    """What the decode gets: the client's bytes up to the tail, then the tail with the
    kv_transfer_params member spliced in before its closing brace; returns those params."""
    length, last = len(raw), answers[-1]
    assert checked_mark(last) is True
    assert not last.request_body.response.header_mutation.set_headers  # no content-length
    decode = b"".join(decode_bytes(c, a) for c, a in zip(chunks, answers, strict=True))
    # Everything before the tail went on as the client sent it.
    assert decode.startswith(raw[: length - TAIL])
    tail = decode_bytes(chunks[-1], last)
    assert len(tail) > TAIL
    assert tail.endswith(b"}")
    parsed = orjson.loads(decode)
    kv: dict[str, Any] = parsed.pop("kv_transfer_params")
    assert parsed == original
    assert (
        tail
        == raw[len(decode) - len(tail) : -1] + b"," + members({"kv_transfer_params": kv}) + b"}"
    )
    return kv


def assert_decode_kv_params(kv: dict[str, Any], h: Harness) -> None:
    assert kv["do_remote_prefill"] is True
    assert kv["do_remote_decode"] is False
    assert kv["remote_bootstrap_addr"] == h.prefill.bootstrap_url
    assert kv["transfer_id"].startswith("xfer-")


def assert_prefill_leg(record: dict[str, Any], kv: dict[str, Any], length: int, h: Harness) -> None:
    """The prefill pod got the whole body, one token's worth, paired with the decode's
    params, with the client's headers but not pdproc's own."""
    assert record["body"]["kv_transfer_params"] == {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "transfer_id": kv["transfer_id"],
    }
    assert record["body"]["max_tokens"] == 1
    assert record["body"]["max_completion_tokens"] == 1
    assert record["body"]["stream"] is False
    assert record["body_bytes"] > length
    rank = int(record["headers"]["x-data-parallel-rank"])
    assert h.prefill.engine_ids[rank] == kv["remote_engine_id"]
    assert record["headers"]["authorization"] == "t"
    assert "x-prefiller-host-port" not in record["headers"]


async def finish_counted_as_pd(call: Any, h: Harness) -> None:
    """The decode answers 200; the stream ends, counted once as P/D, its bytes released."""
    await call.write(response_headers_msg("200"))
    answer = await recv(call)
    assert answer.WhichOneof("response") == "response_headers"
    assert answer == pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    await eventually_async(lambda: h.sample("pdproc_requests_total", path=PATH, outcome="pd") == 1)
    assert h.sample("pdproc_requests_total") == 1
    assert h.sample(STREAMED) == 1
    assert h.sample(IN_FLIGHT) == 0


@pytest.mark.parametrize(
    "sizes",
    [
        [100 * KiB, 100 * KiB],  # the last chunk holds the whole tail: every other passes
        [100 * KiB, 100 * KiB, 100 * KiB],
        "crossing",  # a chunk before the last reaches into the tail: it is cut short
        "inside",  # and one more lies wholly inside it: cleared
    ],
)
async def test_a_large_body_is_streamed_and_only_its_tail_rewritten(
    h: Harness, sizes: list[int] | str
) -> None:
    original, raw = large_chat(max_completion_tokens=100)
    length = len(raw)
    chunks = split(raw, chunk_sizes(sizes, length))
    assert len(chunks) >= 3
    assert b"".join(chunks) == raw

    call = h.open()
    await call.write(headers_msg(extra={**h.target, **length_header(length), "authorization": "t"}))
    assert_streamed_headers(await recv(call))
    answers = await send_chunks(call, chunks)
    assert len(answers) == len(chunks)

    assert_only_the_tail_held(chunks, answers, length)
    kv = assert_rewritten_tail(raw, chunks, answers, original)
    assert_decode_kv_params(kv, h)
    (record,) = await finished_prefills(h, 1)
    assert_prefill_leg(record, kv, length, h)
    await finish_counted_as_pd(call, h)


async def test_an_empty_last_chunk_releases_the_whole_tail(h: Harness) -> None:
    """Envoy may end a stream with an empty chunk: the held tail comes with its answer."""
    original, raw = large_chat()
    call, first = await streamed_call(h, len(raw))
    assert_streamed_headers(first)
    chunks = [raw[: 200 * KiB], raw[200 * KiB :], b""]
    answers = await send_chunks(call, chunks)
    assert answers[0] == pb.ProcessingResponse(request_body=pb.BodyResponse())
    assert decode_bytes(chunks[1], answers[1]) == raw[200 * KiB : len(raw) - TAIL]
    assert checked_mark(answers[2]) is True
    decode = b"".join(decode_bytes(c, a) for c, a in zip(chunks, answers, strict=True))
    parsed = orjson.loads(decode)
    assert "kv_transfer_params" in parsed
    del parsed["kv_transfer_params"]
    assert parsed == original
    await finished_prefills(h, 1)


async def test_sglang_fields_are_spliced_into_a_streamed_tail(
    make_harness: Callable[..., Any],
) -> None:
    """SGLang plans its room before the body: it streams too, the prefill gets the same
    fields. (The simulator is a Mooncake pod: only the launch is checked, not its outcome.)"""
    h: Harness = await make_harness(
        kv_connector=KvConnector.SGLANG, sglang_bootstrap_port=9, stream_body_bytes=256 * KiB
    )
    original, raw = large_chat()
    call, first = await streamed_call(h, len(raw))
    assert_streamed_headers(first)
    chunks = split(raw, [100 * KiB, 100 * KiB])
    answers = await send_chunks(call, chunks)
    assert checked_mark(answers[-1]) is True
    decode = orjson.loads(b"".join(map(decode_bytes, chunks, answers)))
    room = decode.pop("bootstrap_room")
    assert decode == {**original, "bootstrap_host": "127.0.0.1", "bootstrap_port": 9}
    (record,) = await finished_prefills(h, 1)
    assert record["body"]["bootstrap_room"] == room


async def test_a_bootstrap_failure_at_the_end_of_a_streamed_body_gets_502(h: Harness) -> None:
    await h.faults(bootstrap="garbage")
    _, raw = large_chat()
    call, first = await streamed_call(h, len(raw))
    assert_streamed_headers(first)
    answers = await send_chunks(call, split(raw, [100 * KiB, 100 * KiB]))
    assert len(answers) == 3
    assert answers[-1].immediate_response.status.code == 502
    assert await h.prefill_records() == []
    assert h.sample("pdproc_requests_total", path=PATH, outcome="bootstrap_error") == 1
    assert h.sample(IN_FLIGHT) == 0


async def test_a_bootstrap_failure_with_decode_only_releases_the_tail_unchanged(
    make_harness: Callable[..., Any],
) -> None:
    h: Harness = await make_harness(
        stream_body_bytes=256 * KiB, on_bootstrap_error=BootstrapPolicy.DECODE_ONLY
    )
    await h.faults(bootstrap="garbage")
    _, raw = large_chat()
    call, first = await streamed_call(h, len(raw))
    assert_streamed_headers(first)
    chunks = split(raw, [100 * KiB, len(raw) - 100 * KiB - 3])
    answers = await send_chunks(call, chunks)
    assert checked_mark(answers[-1]) is True
    # The client's own bytes, the held tail given back as it was.
    assert b"".join(map(decode_bytes, chunks, answers)) == raw
    assert h.sample("pdproc_requests_total", path=PATH, outcome="decode_only") == 1
    assert await h.prefill_records() == []
    await call.write(response_headers_msg("200"))
    assert (await recv(call)).WhichOneof("response") == "response_headers"
    assert h.sample(IN_FLIGHT) == 0


# --- (b), (c) bad bodies: a 400 at the chunk where it shows --------------------------------


async def test_client_kv_transfer_params_in_a_streamed_body_get_400(h: Harness) -> None:
    evil = {"remote_bootstrap_addr": "http://169.254.169.254:80", "do_remote_prefill": True}
    _, raw = large_chat(kv_transfer_params=evil)
    call, first = await streamed_call(h, len(raw))
    assert_streamed_headers(first)
    chunks = split(raw, [100 * KiB, 100 * KiB])
    answers = await send_chunks(call, chunks)
    # The params went by in the first chunk: only the whole body can be checked, so the
    # last chunk is the one refused (and the decode never gets the end of its body).
    assert len(answers) == len(chunks)
    for answer in answers[:-1]:
        assert answer == pb.ProcessingResponse(request_body=pb.BodyResponse())
    status, message = rejection(answers[-1])
    assert status == 400
    assert "kv_transfer_params" in message
    assert await h.prefill_records() == []
    assert h.sample("pdproc_requests_total", path=PATH, outcome="bad_request") == 1
    assert h.sample(IN_FLIGHT) == 0


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"model": "m", "prompt": "' + b"x" * (300 * KiB) + b'"', "invalid JSON"),
        (b'["' + b"x" * (300 * KiB) + b'"]', "JSON object"),
        (b'{"prompt": "' + b"x" * (300 * KiB) + b'"}' + b" " * 40, "closing brace"),
    ],
    ids=["unterminated", "array", "trailing-blanks"],
)
async def test_a_bad_streamed_body_gets_400_at_its_end(
    h: Harness, body: bytes, expected: str
) -> None:
    call, first = await streamed_call(h, len(body))
    assert_streamed_headers(first)
    # As Envoy reads: large chunks, then the few bytes left over.
    chunks = split(body, [128 * KiB, len(body) - 128 * KiB - 3])
    answers = await send_chunks(call, chunks)
    assert len(answers) == 3
    status, message = rejection(answers[-1])
    assert status == 400
    assert expected in message
    assert await h.prefill_records() == []
    assert h.sample(IN_FLIGHT) == 0


async def test_a_body_shorter_than_its_content_length_gets_400(h: Harness) -> None:
    _, raw = large_chat()
    call, first = await streamed_call(h, len(raw) + 1)
    assert_streamed_headers(first)
    answers = await send_chunks(call, split(raw, [100 * KiB, 100 * KiB]))
    assert len(answers) == 3
    status, message = rejection(answers[-1])
    assert status == 400
    assert "shorter than its content-length" in message
    assert await h.prefill_records() == []
    assert h.sample("pdproc_requests_total", path=PATH, outcome="bad_request") == 1
    assert h.sample(IN_FLIGHT) == 0


async def test_a_body_longer_than_its_content_length_gets_400_at_once(h: Harness) -> None:
    _, raw = large_chat()
    call, first = await streamed_call(h, len(raw) - 10)
    assert_streamed_headers(first)
    chunks = split(raw, [100 * KiB, len(raw) - 100 * KiB - 5])
    # The second chunk already passes the announced length: refused there, not at the end.
    answers = await send_chunks(call, chunks)
    assert len(answers) == 2
    status, message = rejection(answers[-1])
    assert status == 400
    assert "longer than its content-length" in message
    assert await h.prefill_records() == []
    assert h.sample(IN_FLIGHT) == 0


# --- (d), (e), (g) and connectors that never stream: the buffered path ---------------------


async def rewritten_buffered(h: Harness, raw: bytes, headers: dict[str, str]) -> None:
    """The old path: headers answered without a mode switch, the whole body rewritten once."""
    call = h.open()
    await call.write(headers_msg(extra={**h.target, **headers}))
    assert_buffered_headers(await recv(call))
    await call.write(body_msg(raw))
    answer = await recv(call)
    common = answer.request_body.response
    body = common.body_mutation.body
    assert "kv_transfer_params" in orjson.loads(body)
    (length,) = [v for v in common.header_mutation.set_headers if v.header.key == "content-length"]
    assert length.header.raw_value == str(len(body)).encode()
    assert checked_mark(answer) is True


async def test_a_body_below_the_threshold_is_buffered(h: Harness) -> None:
    _, raw = large_chat(200 * KiB)
    assert len(raw) < 256 * KiB
    await rewritten_buffered(h, raw, length_header(len(raw)))
    # Exactly at the threshold it streams.
    call = h.open()
    await call.write(headers_msg(extra={**h.target, **length_header(256 * KiB)}))
    assert_streamed_headers(await recv(call))
    assert h.sample(STREAMED) == 1
    call.cancel()
    await eventually_async(lambda: h.sample(IN_FLIGHT) == 0)


async def test_a_small_request_with_a_tiny_threshold_is_buffered(
    make_harness: Callable[..., Any],
) -> None:
    """No streamed body can be shorter than what is held back."""
    h: Harness = await make_harness(stream_body_bytes=1)
    raw = b'{"prompt":"x"}'
    assert len(raw) <= TAIL
    await rewritten_buffered(h, raw, length_header(len(raw)))
    assert h.sample(STREAMED) == 0


@pytest.mark.parametrize("value", [None, "", "abc", "+307200", "307200 ", "1" * 19])
async def test_without_a_plain_content_length_the_body_is_buffered(
    h: Harness, value: str | None
) -> None:
    _, raw = large_chat()
    await rewritten_buffered(h, raw, {} if value is None else {"content-length": value})
    assert h.sample(STREAMED) == 0


async def test_zero_stream_body_bytes_disables_streaming(
    make_harness: Callable[..., Any],
) -> None:
    h: Harness = await make_harness(stream_body_bytes=0)
    _, raw = large_chat()
    await rewritten_buffered(h, raw, length_header(len(raw)))
    assert h.sample(STREAMED) == 0


async def test_a_body_over_max_body_bytes_is_not_streamed(
    make_harness: Callable[..., Any],
) -> None:
    h: Harness = await make_harness(stream_body_bytes=64 * KiB, max_body_bytes=256 * KiB)
    _, raw = large_chat()
    call = h.open()
    await call.write(headers_msg(extra={**h.target, **length_header(len(raw))}))
    assert_buffered_headers(await recv(call))
    await call.write(body_msg(raw))
    assert rejection(await recv(call))[0] == 413
    assert h.sample(STREAMED) == 0


async def test_a_sequential_connector_never_streams(make_harness: Callable[..., Any]) -> None:
    """NIXL v2 builds the decode leg from the prefill's answer: nothing to stream ahead."""
    h: Harness = await make_harness(kv_connector=KvConnector.NIXLV2, stream_body_bytes=1024)
    _, raw = large_chat()
    call = h.open()
    await call.write(headers_msg(extra={**h.target, **length_header(len(raw))}))
    assert_buffered_headers(await recv(call))
    assert h.sample(STREAMED) == 0
    await call.done_writing()


async def test_pool_mode_min_prompt_above_the_length_keeps_the_body_buffered(
    make_harness: Callable[..., Any], prefill: RunningPrefill
) -> None:
    from pdproc.targets import parse_host_port

    h: Harness = await make_harness(
        prefill=(parse_host_port(prefill.address),),
        stream_body_bytes=64 * KiB,
        pd_min_prompt=512 * KiB,
    )
    _, raw = large_chat()
    call = h.open()
    await call.write(headers_msg(extra=length_header(len(raw))))
    assert_buffered_headers(await recv(call))
    await call.write(body_msg(raw))
    answer = await recv(call)
    assert not answer.request_body.response.HasField("body_mutation")  # decode alone
    assert h.sample("pdproc_requests_total", path=PATH, outcome="short_prompt") == 1
    assert h.sample(STREAMED) == 0


async def test_single_message_mode_never_streams(h: Harness) -> None:
    """No request-headers message: nothing to answer with a mode switch. The body arrives
    whole with the headers as attributes, content-length among them."""
    original, raw = large_chat()
    request = body_msg(raw)
    request.attributes["envoy.filters.http.ext_proc"].update(
        {
            "request.path": PATH,
            "request.method": "POST",
            "request.id": "req-single",
            "request.headers['content-length']": str(len(raw)),
        }
    )
    request.metadata_context.filter_metadata["pdproc"].update({"prefiller": h.prefill.address})
    call = h.open()
    await call.write(request)
    answer = await recv(call)
    assert answer.WhichOneof("response") == "request_body"
    assert not answer.HasField("mode_override")
    common = answer.request_body.response
    decode = orjson.loads(common.body_mutation.body)
    assert "kv_transfer_params" in decode
    del decode["kv_transfer_params"]
    assert decode == original
    # The headers are upstream already: no content-length for Envoy to set.
    assert not common.header_mutation.set_headers
    assert checked_mark(answer) is True
    assert h.sample(STREAMED) == 0
    await eventually_async(lambda: h.sample("pdproc_prefills_total", outcome="2xx") == 1)
    assert h.sample(IN_FLIGHT) == 0


async def test_single_message_mode_partial_chunk_is_not_streamed(h: Harness) -> None:
    """A single-message request's first chunk without end_of_stream (BUFFERED: trailers
    follow it) is refused with a 400, even with a large content-length attribute."""
    _, raw = large_chat()
    request = body_msg(raw[: 100 * KiB], end_of_stream=False)
    request.attributes["envoy.filters.http.ext_proc"].update(
        {
            "request.path": PATH,
            "request.method": "POST",
            "request.headers['content-length']": str(len(raw)),
        }
    )
    request.metadata_context.filter_metadata["pdproc"].update({"prefiller": h.prefill.address})
    call = h.open()
    await call.write(request)
    assert rejection(await recv(call))[0] == 400
    assert h.sample(STREAMED) == 0
    assert h.sample(IN_FLIGHT) == 0


# --- (f) the in-flight byte budget --------------------------------------------------------


async def test_a_streamed_body_holds_the_bytes_that_arrived_until_its_end(h: Harness) -> None:
    """The announced content-length reserves nothing: each chunk counts as it arrives."""
    _, raw = large_chat()
    call, first = await streamed_call(h, len(raw))
    assert_streamed_headers(first)
    assert h.sample(IN_FLIGHT) == 0
    chunks = split(raw, [100 * KiB, 100 * KiB])
    arrived = 0
    for chunk in chunks[:-1]:
        await call.write(body_msg(chunk, end_of_stream=False))
        await recv(call)
        arrived += len(chunk)
        assert h.sample(IN_FLIGHT) == arrived
    await call.write(body_msg(chunks[-1]))
    assert checked_mark(await recv(call)) is True
    # Counted until the prefill pod has read its leg (views of these bytes), then let go.
    await eventually_async(lambda: h.sample(IN_FLIGHT) == 0)
    await call.write(response_headers_msg("200"))
    assert (await recv(call)).WhichOneof("response") == "response_headers"
    await call.done_writing()
    await eventually_async(lambda: h.sample("pdproc_requests_total", path=PATH, outcome="pd") == 1)
    assert h.sample(IN_FLIGHT) == 0


async def test_a_refused_streamed_body_releases_its_budget(h: Harness) -> None:
    _, raw = large_chat(kv_transfer_params={"x": 1})
    call, _ = await streamed_call(h, len(raw))
    await send_chunks(call, split(raw, [200 * KiB]), end=False)
    assert h.sample(IN_FLIGHT) == len(raw)
    await call.write(body_msg(b"", end_of_stream=True))
    assert rejection(await recv(call))[0] == 400
    assert h.sample(IN_FLIGHT) == 0


async def test_a_stream_cut_off_mid_body_releases_its_budget(h: Harness) -> None:
    _, raw = large_chat()
    call, _ = await streamed_call(h, len(raw))
    await call.write(body_msg(raw[: 100 * KiB], end_of_stream=False))
    await recv(call)
    assert h.sample(IN_FLIGHT) == 100 * KiB
    call.cancel()  # the client hung up mid-body; Envoy resets the stream
    await eventually_async(lambda: h.sample("pdproc_streams_active") == 0)
    assert h.sample(IN_FLIGHT) == 0
    assert await h.prefill_records() == []


async def test_a_stream_ended_before_any_body_releases_the_budget(h: Harness) -> None:
    """The headers announced a large body, then the stream ended with part of it."""
    call, first = await streamed_call(h, 300 * KiB)
    assert_streamed_headers(first)
    await call.write(body_msg(b"{" + b" " * KiB, end_of_stream=False))
    await recv(call)
    assert h.sample(IN_FLIGHT) == KiB + 1
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    await eventually_async(lambda: h.sample("pdproc_streams_active") == 0)
    assert h.sample(IN_FLIGHT) == 0


async def refused_at_the_chunk_past_the_budget(h: Harness, raw: bytes) -> list[Any]:
    """A second body fits beside a first one until its bytes pass the budget; its calls."""
    first_call, first = await streamed_call(h, len(raw))
    assert_streamed_headers(first)
    first_chunks = split(raw, [200 * KiB])
    await send_chunks(first_call, first_chunks[:1], end=False)
    assert h.sample(IN_FLIGHT) == 200 * KiB
    second_call, second = await streamed_call(h, len(raw))
    assert_streamed_headers(second)
    answers = await send_chunks(second_call, split(raw, [200 * KiB, 100 * KiB]), end=False)
    assert len(answers) == 2
    assert answers[-1].immediate_response.status.code == 503
    assert h.sample("pdproc_requests_total", path=PATH, outcome="overloaded") == 1
    assert h.sample(IN_FLIGHT) == 200 * KiB  # the refused body's bytes left at once
    answers = await send_chunks(first_call, first_chunks[1:])
    assert checked_mark(answers[-1]) is True
    await eventually_async(lambda: h.sample(IN_FLIGHT) == 0)  # once the prefill pod read it
    return [first_call, second_call]


async def refused_at_the_headers_while_full(h: Harness, raw: bytes) -> list[Any]:
    """A body alone may pass the budget (bounding one body is --max-body-bytes' job), and
    while the budget is full a new streamed body is refused at its headers; their calls."""
    big = raw[:-2] + b" " * 12 + raw[-2:]
    alone_call, alone = await streamed_call(h, len(big))
    assert_streamed_headers(alone)
    await send_chunks(alone_call, split(big, [100 * KiB, 100 * KiB]), end=False)
    assert h.sample(IN_FLIGHT) == len(big)
    full_call, full = await streamed_call(h, len(raw))
    assert full.immediate_response.status.code == 503
    return [alone_call, full_call]


async def test_streamed_bodies_past_max_inflight_bytes_get_503(
    make_harness: Callable[..., Any],
) -> None:
    """Bytes that arrived count: a body whose next chunk would pass the budget while
    another holds bytes is refused (503) at that chunk, and a new one is refused at its
    headers while the budget is full."""
    _, raw = large_chat()
    budget = len(raw) + len(raw) // 2
    h: Harness = await make_harness(stream_body_bytes=256 * KiB, max_inflight_bytes=budget)
    calls = await refused_at_the_chunk_past_the_budget(h, raw)
    h2: Harness = await make_harness(stream_body_bytes=256 * KiB, max_inflight_bytes=len(raw) // 2)
    calls += await refused_at_the_headers_while_full(h2, raw)
    for call in calls:
        call.cancel()
    await eventually_async(lambda: h.sample(IN_FLIGHT) == 0 and h2.sample(IN_FLIGHT) == 0)
    assert h.sample(STREAMED) == 2


async def test_request_trailers_after_a_streamed_body_are_refused(h: Harness) -> None:
    """A body followed by trailers (HTTP/2) has no chunk marked as its last, so its end can
    never be rewritten; the headers answer asks for the trailers to see that end."""
    _, raw = large_chat()
    call, first = await streamed_call(h, len(raw))
    assert_streamed_headers(first)
    assert first.mode_override.request_trailer_mode == ProcessingMode.SEND
    chunks = split(raw, [100 * KiB, 100 * KiB])
    answers = await send_chunks(call, chunks, end=False)
    assert len(answers) == 3
    # The held tail never went on to the decode.
    assert b"".join(map(decode_bytes, chunks, answers)) == raw[: len(raw) - TAIL]
    await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    answer = await recv(call)
    assert answer.immediate_response.status.code == 400
    assert b"trailers" in answer.immediate_response.body
    await call.done_writing()
    await eventually_async(lambda: h.sample("pdproc_streams_active") == 0)
    assert h.sample(IN_FLIGHT) == 0
    assert await h.prefill_records() == []
    assert h.sample("pdproc_requests_total", outcome="bad_request") == 1


@pytest.mark.parametrize(("status", "outcome"), [("400", "unfinished_body"), ("413", "too_large")])
async def test_an_answer_before_a_streamed_body_ended_goes_through_counted_once(
    h: Harness, status: str, outcome: str
) -> None:
    """Response headers for a streamed body whose end pdproc never released: Envoy's own 413
    (the kv guard's buffer overflowed) or the decode's answer to a body it never got whole.
    The client gets that answer as it is; the request is counted once, by what it was."""
    _, raw = large_chat()
    call, first = await streamed_call(h, len(raw))
    assert_streamed_headers(first)
    chunks = split(raw, [100 * KiB, 100 * KiB])
    await send_chunks(call, chunks, end=False)
    await call.write(response_headers_msg(status))
    answer = await recv(call)
    assert answer.WhichOneof("response") == "response_headers"
    assert not answer.HasField("immediate_response")
    assert h.sample(IN_FLIGHT) == 0
    await call.done_writing()
    await eventually_async(lambda: h.sample("pdproc_streams_active") == 0)
    assert await h.prefill_records() == []
    assert h.sample("pdproc_requests_total") == 1
    assert h.sample("pdproc_requests_total", outcome=outcome) == 1
