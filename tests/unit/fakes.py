"""Stand-ins for what a processor or a stream is handed, so each is tested alone, in this
process, with no server, no pod and no network: the engine maps, the prefill launcher, the
outcome counter and Envoy's side of the gRPC stream. Each records what it was asked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import grpc
import msgspec
import orjson
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span

from pdproc import extproc_messages as msg
from pdproc._proto.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc.budget import ByteBudget
from pdproc.config import Settings
from pdproc.connectors import ClientRequest, Concurrent, EngineMap, Legs
from pdproc.engine_maps import BootstrapError
from pdproc.extproc_wire import Body, read_request, write_response
from pdproc.ledger import Ledger
from pdproc.metrics import Metrics
from pdproc.outcomes import Outcome, PrefillResult
from pdproc.pod_load import PodLoad
from pdproc.pod_verdict import Verdict
from pdproc.prefill import PrefillJob, PrefillOutcome
from pdproc.processors import Deps, RequestContext
from pdproc.targets import HostPort

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 50}
CHAT_BYTES = orjson.dumps(CHAT)
PATH = "/v1/chat/completions"
POD = HostPort("10.0.0.7", 8000)


class Counted:
    """The outcome counter (pdproc.service.ExtProcService.count): what was counted."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[str, Outcome]] = []

    def count(self, path: str, outcome: Outcome) -> None:
        self.outcomes.append((path, outcome))

    @property
    def only(self) -> Outcome:
        """The one outcome counted (fails unless exactly one was)."""
        assert len(self.outcomes) == 1, self.outcomes
        return self.outcomes[0][1]


class FakeEngines:
    def __init__(self, engines: EngineMap | None = None) -> None:
        self.engines = engines or {0: "engine-0"}
        self.error: BootstrapError | None = None
        self.errors: dict[HostPort, BootstrapError] = {}  # by target, before `error`
        self.prefetched: list[HostPort] = []
        self.asked: list[HostPort] = []
        self.invalidated: list[HostPort] = []

    def prefetch(self, target: HostPort, span: Span | None = None) -> None:
        self.prefetched.append(target)

    async def get(self, target: HostPort, span: Span | None = None) -> EngineMap:
        self.asked.append(target)
        if target in self.errors:
            raise self.errors[target]
        if self.error is not None:
            raise self.error
        return self.engines

    def invalidate(self, target: HostPort) -> None:
        self.invalidated.append(target)

    def learn(self, target: HostPort, verdict: Verdict) -> None:
        if verdict.map_may_be_stale:  # the rule pdproc.engine_maps.EngineMaps.learn follows
            self.invalidated.append(target)


class FakeLauncher:
    """Launches nothing: each job's outcome is settled by the test (`settle`). Its task
    stands for the exchange with the pod: cancelled, it settles `cancelled` as the real
    launcher's does."""

    timeout_s = 60.0

    def __init__(self) -> None:
        self.jobs: list[PrefillJob] = []
        # False: each job's prefill body stays unsent until the test resolves `body_sent`.
        self.sends_at_once = True

    def in_flight(self, target: HostPort) -> int:
        return sum(1 for job in self.jobs if job.target == target and not job.outcome.done())

    def in_flight_by_rank(self, target: HostPort) -> Mapping[int, int]:
        return {}

    def launch(
        self,
        *,
        target: HostPort,
        legs: Legs,
        path: str,
        client_headers: Mapping[str, str],
        parent_span: Span | None = None,
        log_fields: Mapping[str, Any] | None = None,
        keep_answer: bool = False,
    ) -> PrefillJob:
        loop = asyncio.get_running_loop()
        job = PrefillJob(
            target,
            legs,
            client_headers.get("x-request-id", ""),
            path,
            time.perf_counter(),
            loop.create_future(),
            keep_answer=keep_answer,
            log_fields=dict(log_fields or {}),
            body_sent=loop.create_future(),
        )
        if self.sends_at_once:
            job.body_sent.set_result(None)  # type: ignore[union-attr]
        job.task = loop.create_task(self._exchange(job))
        self.jobs.append(job)
        return job

    async def _exchange(self, job: PrefillJob) -> None:
        try:
            await asyncio.shield(job.outcome)
        except asyncio.CancelledError:
            _settle(job, PrefillResult.CANCELLED)
            raise

    @property
    def job(self) -> PrefillJob:
        assert len(self.jobs) == 1, self.jobs
        return self.jobs[0]

    async def close(self) -> None:
        for job in self.jobs:
            if job.task is not None and not job.task.done():
                job.task.cancel()
                await asyncio.gather(job.task, return_exceptions=True)


async def settle(job: PrefillJob, result: PrefillResult, **kw: Any) -> None:
    """The prefill ends with `result`; what waits on it (callbacks included) has run."""
    _settle(job, result, **kw)
    await asyncio.sleep(0)


def _settle(job: PrefillJob, result: PrefillResult, **kw: Any) -> None:
    if not job.outcome.done():
        job.outcome.set_result(PrefillOutcome(result, 0.01, **kw))


class World:
    """One process's worth of dependencies, all fakes but the settings, metrics and budget."""

    def __init__(self, **settings: Any) -> None:
        self.settings = Settings(**settings)
        self.metrics = Metrics()
        self.budget = ByteBudget(self.settings.max_inflight_bytes)
        self.engines = FakeEngines()
        self.launcher = FakeLauncher()
        self.pod_failures: list[tuple[HostPort, str]] = []
        self.admitted: set[HostPort] = set()
        self.counted = Counted()
        self.aborts: list[pb.ProcessingResponse] = []
        self.pool: list[HostPort] = []  # what `reroute` offers, in order
        self.deps = Deps(
            settings=self.settings,
            metrics=self.metrics,
            budget=self.budget,
            engines=self.engines,
            launcher=self.launcher,
            pod_failed=lambda target, outcome: self.pod_failures.append((target, outcome)),
            admits=self.admitted.__contains__,
            load=PodLoad(self.launcher.in_flight),
            reroute=lambda tried: next((m for m in self.pool if m not in tried), None),
        )

    def context(
        self,
        headers: Mapping[str, str] | None = None,
        *,
        single_message: bool = False,
        id_replaced: bool = False,
        span: Span | None = None,
    ) -> RequestContext:
        values = {":path": PATH, ":method": "POST", "x-request-id": "req-1", **(headers or {})}
        return RequestContext(
            values,
            PATH,
            span,
            Ledger(self.counted, PATH, span),
            single_message=single_message,
            id_replaced=id_replaced,
        )

    def abort(self, response: pb.ProcessingResponse) -> None:
        self.aborts.append(response)


def recording_span() -> SdkSpan:
    span = TracerProvider().get_tracer("pdproc-tests").start_span("request")
    assert isinstance(span, SdkSpan)
    return span


def body(raw: bytes = CHAT_BYTES, end_of_stream: bool = True) -> Body:
    return Body(raw, end_of_stream)


def response_headers(status: str = "200") -> pb.HttpHeaders:
    return pb.HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=":status", raw_value=status.encode())])
    )


def wire(answer: msg.Answer) -> pb.ProcessingResponse:
    """An answer as Envoy reads it: serialised by pdproc's serializer, parsed by protobuf."""
    return pb.ProcessingResponse.FromString(write_response(answer))


class FakeCall:
    """Envoy's side of one ext_proc stream, as grpc.aio's servicer context shows it: what
    Envoy sends is queued by the test (`send`, `end`), what pdproc writes is kept."""

    def __init__(self, metadata: tuple[tuple[str, Any], ...] = ()) -> None:
        self._incoming: asyncio.Queue[Any] = asyncio.Queue()
        self.written: list[pb.ProcessingResponse] = []
        self.wrote = asyncio.Event()
        self.fail_writes: BaseException | None = None
        self._metadata = metadata

    def send(self, message: pb.ProcessingRequest | BaseException) -> None:
        self._incoming.put_nowait(message)

    def end(self) -> None:
        self._incoming.put_nowait(grpc.aio.EOF)

    async def read(self) -> Any:
        message = await self._incoming.get()
        if isinstance(message, BaseException):
            raise message
        if message is grpc.aio.EOF:
            return message
        # As gRPC hands it to pdproc: through pdproc's own deserializer.
        return read_request(message.SerializeToString())

    async def write(self, response: msg.Answer) -> None:
        if self.fail_writes is not None:
            raise self.fail_writes
        # As Envoy reads it: serialised by pdproc's serializer, parsed by protobuf.
        self.written.append(wire(response))
        self.wrote.set()

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    async def next_write(self) -> pb.ProcessingResponse:
        """Wait (bounded) for the next answer written after the ones already seen."""
        seen = len(self.written)
        async with asyncio.timeout(10):
            while len(self.written) == seen:
                self.wrote.clear()
                await self.wrote.wait()
        return self.written[seen]


def both_legs(
    connector: Concurrent,
    request: ClientRequest,
    target: HostPort,
    engines: EngineMap | None,
    in_flight_by_rank: Mapping[int, int],
) -> Legs:
    """Both legs of a concurrent connector's request, built as the processor builds them
    for a body it holds whole: the plan, the decode leg, then the prefill leg."""
    plan = connector.plan(target, engines, in_flight_by_rank)
    return connector.prefill_leg(request, plan, connector.decode_leg(request, plan))


def value_of(members: Mapping[str, Any], key: str) -> Any:
    """A parsed body member's value as Python data (the parser keeps members as raw JSON)."""
    value = members[key]
    return msgspec.json.decode(value) if isinstance(value, msgspec.Raw) else value
