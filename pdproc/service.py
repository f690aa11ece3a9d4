"""The ext_proc gRPC service: what all streams share, and the choice of a processor.

One `ExtProcService` per process holds the settings, the engine-id cache, the prefill
launcher, the breakers and the metrics. Each gRPC stream is one HTTP request; when its
headers arrive the service decides what the request is (`open_request`) and returns the
processor that answers it (see processors.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Any

from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from pdproc._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from pdproc.breaker import CircuitBreakers
from pdproc.budget import ByteBudget
from pdproc.config import BootstrapPolicy, DecodeChoice, KvConnector, PoolPolicy, Settings
from pdproc.connectors import ClientRequest, Concurrent, Connector
from pdproc.decode_choice import DecodePick, DecodePool
from pdproc.discovery import DnsPool
from pdproc.engine_maps import EngineMaps
from pdproc.errors import ErrorKind, ErrorReply, shown
from pdproc.extproc_wire import BodyRequest
from pdproc.ledger import Ledger
from pdproc.metrics import Metrics
from pdproc.outcomes import Outcome
from pdproc.picker import (
    BadRequest,
    Chosen,
    Forbidden,
    NoTarget,
    Pick,
    Rotation,
    Unavailable,
    Unproven,
    choose_member,
    pick_target,
)
from pdproc.pod_load import PodLoad
from pdproc.pod_verdict import Verdict, of_prefill
from pdproc.pool_choice import PrefixPool
from pdproc.prefill import OutcomeHook, PrefillJob, PrefillLauncher, PrefillOutcome
from pdproc.prefix_affinity import Prompt
from pdproc.processors import (
    Abort,
    ConcurrentPair,
    DecodeOnly,
    Deps,
    PassThrough,
    Rejected,
    RequestContext,
    RequestProcessor,
    SequentialPair,
)
from pdproc.request_ids import is_plain, new_request_id
from pdproc.stream import ServicerContext, Stream
from pdproc.targets import PREFILL_HEADER, HostPort
from pdproc.telemetry import Tracing
from pdproc.unproven import UnprovenPorts

log = logging.getLogger(__name__)
REQUEST_ID = "x-request-id"


class ExtProcService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        settings: Settings,
        connector: Connector,
        engines: EngineMaps,
        launcher: PrefillLauncher,
        breakers: CircuitBreakers,
        metrics: Metrics,
        tracing: Tracing | None = None,
        dns_pool: DnsPool | None = None,
        unproven: UnprovenPorts | None = None,
        decode_dns: DnsPool | None = None,
    ) -> None:
        self.settings = settings
        self.connector = connector
        self.engines = engines
        self.launcher = launcher
        self.breakers = breakers
        self.metrics = metrics
        self.tracing = tracing or Tracing(None)
        self.dns_pool = dns_pool
        self.decode_dns = decode_dns
        self._static_pool = frozenset(settings.prefill)
        if unproven is None:
            unproven = UnprovenPorts(
                settings.breaker_failures,
                settings.breaker_cooldown,
                is_member=self.is_pool_member,
                max_targets=settings.max_targets,
            )
        self.unproven = unproven
        self.draining = False  # shutting down: no new prefills, the decode serves alone
        self._outcome_counters: dict[tuple[str, str, str], Any] = {}
        self.load = PodLoad(launcher.in_flight)
        self._tie = Rotation()
        self.budget = ByteBudget(settings.max_inflight_bytes, metrics.bodies_bytes.set)
        self.prefix_pool: PrefixPool | None = None
        if settings.pool_policy is PoolPolicy.PREFIX:
            self.prefix_pool = PrefixPool(
                self.pool,
                is_open=breakers.is_open,
                allow=breakers.allow,
                in_flight=self.load,
                blocks_per_pod=settings.prefix_blocks_per_pod,
                balance=settings.prefix_balance,
                on_choice=lambda reason: metrics.pool_choices.labels(reason).inc(),
                on_index=metrics.prefix_index_blocks.set,
            )
        self.decode_pool: DecodePool | None = None
        if settings.decode_choice is DecodeChoice.PREFIX:
            self.decode_pool = DecodePool(
                self.decodes,
                blocks_per_pod=settings.prefix_blocks_per_pod,
                balance=settings.prefix_balance,
                skip_fraction=_skip_fraction(settings),
                on_choice=lambda reason: metrics.decode_choices.labels(reason).inc(),
            )
        self.deps = Deps(
            settings=settings,
            metrics=metrics,
            budget=self.budget,
            engines=engines,
            launcher=launcher,
            pod_failed=self._pod_failed,
            admits=self.admits,
            load=self.load,
            reroute=self.reroute,
            refine=self.prefix_pool.refine if self.prefix_pool else None,
            engines_seen=self.prefix_pool.engines_seen if self.prefix_pool else None,
            choose_decode=self._choose_decode if self.decode_pool else None,
        )

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest | BodyRequest],
        context: ServicerContext,
    ) -> None:
        stream = Stream(self, context)
        gauge = self.metrics.streams_active
        gauge.inc()
        try:
            await stream.run()
        finally:
            gauge.dec()
            stream.close()

    def open_request(
        self,
        headers: dict[str, str],
        end_of_stream: bool,
        *,
        single_message: bool,
        call_metadata: Callable[[], Mapping[str, str]],
        abort: Abort,
    ) -> RequestProcessor:
        """What this request is, decided from its headers."""
        path = headers.get(":path", "").split("?", 1)[0]
        method = headers.get(":method", "")
        replaced = _replace_unplain_request_id(headers)
        span = self.tracing.request_span(headers, path, method, call_metadata)
        context = RequestContext(
            headers,
            path,
            span,
            Ledger(self, path, span),
            single_message=single_message,
            id_replaced=replaced,
        )
        if end_of_stream or method != "POST" or path not in self.settings.pd_path:
            return PassThrough(context)
        if self.draining:
            return DecodeOnly(context, self.deps, Outcome.PASSTHROUGH)
        return self._processor_for(self._pick(headers), context, abort)

    def _pick(self, headers: Mapping[str, str]) -> Pick:
        return pick_target(
            headers.get(PREFILL_HEADER),
            self.pool(),
            allow=self.settings.prefill_allow,
            in_pool=self.is_pool_member,
            breaker_allows=self.breakers.allow,
            load=self.load,
            tie=self._tie,
            unproven_allows=self.unproven.allow,
        )

    def _pod_failed(self, target: HostPort, verdict: Verdict) -> None:
        """What a failed bootstrap query says about the target's pod."""
        self.breakers.record(target, verdict)
        self.unproven.record(target, verdict)

    def reroute(self, tried: Collection[HostPort]) -> HostPort | None:
        """Another usable pool member than those `tried`, for a request whose bootstrap
        query failed before anything was sent."""
        return choose_member(
            self.pool(), usable=self.breakers.allow, load=self.load, excluded=tried
        )

    def _processor_for(self, pick: Pick, context: RequestContext, abort: Abort) -> RequestProcessor:
        """The processor that follows the picker's answer."""
        match pick:
            case Chosen(target, from_pool):
                return self._pair(context, target, abort, from_pool=from_pool)
            case NoTarget():
                return DecodeOnly(context, self.deps, Outcome.PASSTHROUGH)
            case Unproven(reason):
                self.metrics.unproven_refusals.inc()
                return self._unavailable(context, reason)
            case Unavailable(reason):
                return self._unavailable(context, reason)
            case Forbidden(reason):
                return Rejected(context, ErrorReply(ErrorKind.FORBIDDEN, reason))
            case BadRequest(reason):
                return Rejected(context, ErrorReply(ErrorKind.BAD_REQUEST, reason))

    def _unavailable(self, context: RequestContext, reason: str) -> RequestProcessor:
        """No prefill may serve the request now: rejected, or decode-only by the policy."""
        if self.settings.on_bootstrap_error is BootstrapPolicy.DECODE_ONLY:
            return DecodeOnly(context, self.deps, Outcome.DECODE_ONLY, reason)
        return Rejected(context, ErrorReply(ErrorKind.PREFILL_UNAVAILABLE, reason))

    def _pair(
        self, context: RequestContext, target: HostPort, abort: Abort, *, from_pool: bool
    ) -> RequestProcessor:
        """The prefill/decode pair for `target`, of the connector's kind."""
        # Pool mode may leave a short prompt to the decode; an endpoint picker's choice is kept.
        min_prompt = self.settings.pd_min_prompt if from_pool else 0
        connector = self.connector
        if isinstance(connector, Concurrent):
            return ConcurrentPair(
                context,
                self.deps,
                connector,
                target,
                abort,
                min_prompt=min_prompt,
                from_pool=from_pool,
            )
        return SequentialPair(
            context, self.deps, connector, target, min_prompt=min_prompt, from_pool=from_pool
        )

    def ledger(self, path: str) -> Ledger:
        """A ledger for a stream that never became a request (its first message unreadable,
        or a bug before its processor existed)."""
        return Ledger(self, path)

    def count(self, path: str, outcome: Outcome) -> None:
        key = (path if path in self.settings.pd_path else "other", outcome, self.connector.name)
        counter = self._outcome_counters.get(key)
        if counter is None:
            counter = self._outcome_counters[key] = self.metrics.requests.labels(*key)
        counter.inc()

    def pool(self) -> tuple[HostPort, ...]:
        """Operator-given prefill pods: the static pool plus what DNS currently resolves to."""
        if self.dns_pool is None:
            return self.settings.prefill
        return self.settings.prefill + self.dns_pool.members

    def decodes(self) -> tuple[HostPort, ...]:
        """The decode pods pdproc may name: the static ones plus what DNS resolves to."""
        if self.decode_dns is None:
            return self.settings.decode
        return self.settings.decode + self.decode_dns.members

    def _choose_decode(self, request: ClientRequest) -> DecodePick | None:
        assert self.decode_pool is not None
        return self.decode_pool.choose(Prompt.of(request.parsed))

    def prefill_ended(self, job: PrefillJob, outcome: PrefillOutcome) -> None:
        if self.prefix_pool is None:
            return
        if outcome.answer is not None or not outcome.ok:
            # A sequential connector's answer is in its outcome; a concurrent one's success
            # is read after its status line (prefill_answered).
            self.prefix_pool.answered(job.request_id, job.target, outcome.answer)
        verdict = of_prefill(outcome.outcome)
        if verdict in (Verdict.DOWN, Verdict.FAILED) and self.is_pool_member(job.target):
            self.prefix_pool.prefill_failed(job.target)

    def prefill_answered(self, job: PrefillJob, answer: bytes) -> None:
        """The start of a successful answer the prefill's status line had settled."""
        if self.prefix_pool is not None:
            self.prefix_pool.answered(job.request_id, job.target, answer)

    def breaker_changed(self, target: HostPort, is_open: bool) -> None:
        if is_open and self.prefix_pool is not None:
            self.prefix_pool.breaker_opened(target)

    def admits(self, address: HostPort) -> bool:
        """Whether the gateway lets `address` be a KV source a prefill pod names (NIXL's side
        channel): the allow list admits it, or it is on a pool member's host."""
        return self.settings.prefill_allow.allows(address) or any(
            member.host == address.host for member in self.pool()
        )

    def is_pool_member(self, target: HostPort) -> bool:
        return target in self._static_pool or (
            self.dns_pool is not None and target in self.dns_pool.members
        )


def _skip_fraction(settings: Settings) -> float:
    """--decode-skip-pd-fraction, unless the decodes cannot serve a request alone: an SGLang
    decode in disaggregation mode refuses a request without a bootstrap room."""
    if settings.kv_connector is KvConnector.SGLANG:
        return 0.0
    return settings.decode_skip_pd_fraction


def _replace_unplain_request_id(headers: dict[str, str]) -> bool:
    """Replace a client x-request-id that is not a plain token; whether it was replaced.
    Logs, spans and the prefill leg never carry the client's raw value."""
    client_id = headers.get(REQUEST_ID)
    if not client_id or is_plain(client_id):
        return False
    headers[REQUEST_ID] = new_request_id()
    log.info(
        "client x-request-id replaced: not a plain token of at most 128 characters",
        extra={"request_id": headers[REQUEST_ID], "client_request_id": shown(client_id)},
    )
    return True


def pod_feedback(
    breakers: CircuitBreakers, engines: EngineMaps, unproven: UnprovenPorts | None = None
) -> OutcomeHook:
    """What a prefill's outcome teaches about its pod (the launcher calls it for each)."""

    def on_prefill_outcome(job: PrefillJob, outcome: PrefillOutcome) -> None:
        verdict = of_prefill(outcome.outcome)
        breakers.record(job.target, verdict)
        if unproven is not None:
            unproven.record(job.target, verdict)
        engines.learn(job.target, verdict)

    return on_prefill_outcome
