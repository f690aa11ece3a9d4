"""Property-based: arbitrary ProcessingRequest sequences and bodies never break the stream
protocol, crash the processor or leak a stream or a task."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdproc_sim import PrefillConfig, RunningPrefill, start_prefill
from prometheus_client import CollectorRegistry

from pdproc._proto.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from pdproc.config import Settings
from pdproc.server import Server
from pdproc.targets import AllowList, HostPort
from tests.envoy_side import channel
from tests.hypothesis_budget import examples
from tests.metric_samples import sample_sum

REQUEST_TO_RESPONSE = {
    "request_headers": "request_headers",
    "request_body": "request_body",
    "request_trailers": "request_trailers",
    "response_headers": "response_headers",
    "response_body": "response_body",
    "response_trailers": "response_trailers",
}


class Background:
    """The processor and a simulated prefill pod on their own event loop thread, so the
    test can use a plain blocking gRPC client as Envoy's stand-in."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.prefill: RunningPrefill = self.run(start_prefill(PrefillConfig(dp_ranks=2)))
        assert self.prefill.bootstrap_port is not None
        self.server = Server(
            Settings(
                listen=HostPort("127.0.0.1", 0),
                mooncake_bootstrap_port=self.prefill.bootstrap_port,
                prefill_allow=AllowList.parse(["127.0.0.1/32"]),
                prefill_timeout=5,
                max_body_bytes=64 * 1024,
            )
        )
        self.run(self.server.start())
        self.sequences = 0  # sent by the property test on this server

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.run(self.server.stop(drain_timeout_s=5))
        self.run(self.prefill.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def background() -> Iterator[Background]:
    bg = Background()
    yield bg
    bg.close()


def headers(values: dict[str, str], end_of_stream: bool) -> pb.HttpHeaders:
    return pb.HttpHeaders(
        headers=HeaderMap(
            headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        ),
        end_of_stream=end_of_stream,
    )


json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_value = st.recursive(
    json_leaf,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=10,
)
chat_body = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.just([{"role": "user", "content": "hi"}])},
    optional={
        "max_tokens": st.integers(-5, 10**20),
        "min_tokens": st.integers(0, 50),
        "n": st.integers(0, 5),
        "stream": st.booleans(),
        "stream_options": json_value,
        "kv_transfer_params": json_value,
        "stop": json_value,
    },
).map(lambda body: json.dumps(body).encode())
deep = st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n)
body_bytes = st.one_of(
    chat_body,
    st.binary(max_size=300),
    json_value.map(lambda v: json.dumps(v).encode()),
    deep,
    st.just(400).map(lambda n: b'{"a": 1' + b"9" * n + b"}"),  # a huge number
    st.just(b'{"prompt": "\xff\xfe"}'),  # not UTF-8
    st.just(70_000).map(lambda n: b'{"p": "' + b"x" * n + b'"}'),  # over the 64 KiB limit
)


def target_header(prefill: RunningPrefill) -> st.SearchStrategy[dict[str, str]]:
    return st.sampled_from(
        [
            {},
            {"x-prefiller-host-port": prefill.address},
            {"x-prefiller-host-port": f"{prefill.address},10.0.0.1:1"},
            {"x-prefiller-host-port": "127.0.0.2:1"},  # not allowed: never contacted
            {"x-prefiller-host-port": "garbage"},
            {"x-prefiller-host-port": ""},
        ]
    )


def messages(prefill: RunningPrefill) -> st.SearchStrategy[list[pb.ProcessingRequest]]:
    request_headers = st.builds(
        lambda method, path, target, eos: pb.ProcessingRequest(
            request_headers=headers({":method": method, ":path": path, **target}, eos)
        ),
        st.sampled_from(["POST", "GET", "PUT"]),
        st.sampled_from(["/v1/chat/completions", "/v1/completions?x=1", "/v1/models", "/x"]),
        target_header(prefill),
        st.booleans(),
    )
    request_body = st.builds(
        lambda body, eos: pb.ProcessingRequest(
            request_body=pb.HttpBody(body=body, end_of_stream=eos)
        ),
        body_bytes,
        st.booleans(),
    )
    response_headers = st.sampled_from(["200", "500", "404", ""]).map(
        lambda status: pb.ProcessingRequest(response_headers=headers({":status": status}, False))
    )
    other = st.sampled_from(
        [
            pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x\n\n")),
            pb.ProcessingRequest(response_trailers=pb.HttpTrailers()),
        ]
    )
    well_ordered = st.tuples(request_headers, request_body, response_headers).map(list)
    anything = st.lists(
        st.one_of(request_headers, request_body, response_headers, other), max_size=6
    )
    pd_headers = st.builds(
        lambda path, target: pb.ProcessingRequest(
            request_headers=headers({":method": "POST", ":path": path, **target}, False)
        ),
        st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
        st.sampled_from(
            [{"x-prefiller-host-port": prefill.address}, {"x-prefiller-host-port": "127.0.0.2:1"}]
        ),
    )
    # Mostly well-formed P/D requests, so every run exercises the prefill and the hold.
    pd_body = st.builds(
        lambda body: pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        st.one_of(chat_body, chat_body, body_bytes),
    )
    pd_exchange = st.tuples(pd_headers, pd_body, response_headers).map(list)
    return st.one_of(pd_exchange, well_ordered, anything)


def check_answers(sent: list[pb.ProcessingRequest], answers: list[pb.ProcessingResponse]) -> None:
    """Exactly one answer per message, in order, unless an ImmediateResponse ended the
    request; a bare timeout override only ever precedes the response-headers answer."""
    expected = [REQUEST_TO_RESPONSE[m.WhichOneof("request")] for m in sent]
    phase: list[str] = []
    for i, answer in enumerate(answers):
        kind = answer.WhichOneof("response")
        if kind == "immediate_response":
            assert i == len(answers) - 1, "nothing may follow an ImmediateResponse"
            assert len(phase) <= len(expected)
            assert 400 <= answer.immediate_response.status.code <= 599
            error = orjson.loads(answer.immediate_response.body)
            assert error["object"] == "error"
            return
        if kind is None:
            assert answer.HasField("override_message_timeout")
            assert expected[len(phase)] == "response_headers"
            continue
        phase.append(kind)
    assert phase == expected


async def exchange(port: int, sent: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """Talk like Envoy: send a message, wait for its answer, and only then the next one;
    stop once an ImmediateResponse ends the request; half-close at the end."""
    answers: list[pb.ProcessingResponse] = []
    async with channel(port) as to_pdproc:
        call = pb_grpc.ExternalProcessorStub(to_pdproc).Process(timeout=30)
        for message in sent:
            await call.write(message)
            while True:
                answer = await call.read()
                assert answer is not grpc.aio.EOF, "stream ended without an answer"
                answers.append(answer)
                if answer.WhichOneof("response") is not None:
                    break  # a bare timeout override: the real answer follows
            if answer.HasField("immediate_response"):
                break
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    return answers


@settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_any_message_sequence_gets_a_valid_answer(
    background: Background, data: st.DataObject
) -> None:
    sent = data.draw(messages(background.prefill))
    background.sequences += 1
    answers = background.run(exchange(background.server.port, sent))
    check_answers(sent[: _answered(answers, sent)], answers)


def _answered(answers: list[pb.ProcessingResponse], sent: list[pb.ProcessingRequest]) -> int:
    """How many messages were sent: all of them, unless an ImmediateResponse came first."""
    if answers and answers[-1].HasField("immediate_response"):
        return sum(1 for a in answers[:-1] if a.WhichOneof("response") is not None) + 1
    return len(sent)


def test_nothing_leaks_afterwards(background: Background) -> None:
    """Runs after the property test: every stream closed, every prefill finished."""
    if not background.sequences:
        # pytest-xdist ran the property test in another worker, on another server.
        test_any_message_sequence_gets_a_valid_answer(background)
    metrics = background.server.metrics.registry
    _wait_drained(background, 20)
    assert metrics.get_sample_value("pdproc_streams_active") == 0
    assert background.server.service is not None
    assert sample_sum(metrics, "pdproc_prefills_in_flight") == 0
    # The sequences did reach every part: P/D pairs, rejections and passthroughs.
    outcomes = _counted_outcomes(metrics)
    assert {"pd", "passthrough", "forbidden"} <= outcomes, outcomes
    assert outcomes & {"bad_request", "too_large"}, outcomes
    tasks = background.run(_task_names())
    assert [t for t in tasks if t.startswith("prefill")] == []


def _wait_drained(background: Background, timeout_s: float) -> None:
    """Until no stream is open and no prefill in flight, or `timeout_s` passed."""
    metrics = background.server.metrics.registry
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        streams = metrics.get_sample_value("pdproc_streams_active")
        assert background.server.service is not None
        prefills = sample_sum(metrics, "pdproc_prefills_in_flight")
        if streams == 0 and prefills == 0:
            break
        time.sleep(0.05)


def _counted_outcomes(metrics: CollectorRegistry) -> set[str]:
    """The outcomes pdproc_requests_total counted at least once."""
    return {
        s.labels["outcome"]
        for family in metrics.collect()
        if family.name == "pdproc_requests"
        for s in family.samples
        if s.name == "pdproc_requests_total" and s.value > 0
    }


async def _task_names() -> list[str]:
    current = asyncio.current_task()
    return [t.get_name() for t in asyncio.all_tasks() if t is not current]
