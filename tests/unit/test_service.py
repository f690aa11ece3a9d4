"""The service's choice of a processor for each request, its outcome counter, and what a
prefill's outcome teaches about the pod (pdproc.service), without a gRPC server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from pdproc.breaker import CircuitBreakers
from pdproc.config import BootstrapPolicy, Settings
from pdproc.connectors import Legs
from pdproc.connectors.mooncake import Mooncake
from pdproc.connectors.nixlv2 import NixlV2
from pdproc.metrics import Metrics
from pdproc.outcomes import Outcome, PrefillResult
from pdproc.pod_verdict import Verdict
from pdproc.prefill import PrefillJob, PrefillLauncher, PrefillOutcome
from pdproc.processors import ConcurrentPair, DecodeOnly, PassThrough, Rejected, SequentialPair
from pdproc.request_body import Pieces
from pdproc.service import ExtProcService, pod_feedback
from pdproc.targets import AllowList

from .fakes import POD, FakeEngines
from .test_processors import status

PATH = "/v1/chat/completions"


class Service:
    def __init__(self, session: aiohttp.ClientSession, connector: Any = None, **kw: Any) -> None:
        self.settings = Settings(prefill_allow=AllowList.parse(["10.0.0.0/24"]), **kw)
        self.metrics = Metrics()
        self.breakers = CircuitBreakers(1, 30.0)
        self.engines = FakeEngines()
        launcher = PrefillLauncher(session, self.metrics, timeout_s=5.0)
        self.service = ExtProcService(
            self.settings,
            connector or Mooncake(8998),
            self.engines,  # type: ignore[arg-type]
            launcher,
            self.breakers,
            self.metrics,
        )

    def open(self, **headers: str) -> Any:
        values = {":method": "POST", ":path": PATH, "x-request-id": "req-1"}
        values.update({k.replace("_", "-"): v for k, v in headers.items()})
        return self.service.open_request(
            values, False, single_message=False, call_metadata=dict, abort=lambda _: None
        )

    def counted(self, outcome: str, path: str = PATH) -> float:
        value = self.metrics.registry.get_sample_value(
            "pdproc_requests_total",
            {"path": path, "outcome": outcome, "connector": self.service.connector.name},
        )
        return value or 0.0


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def test_what_is_not_a_pd_request_passes_and_is_counted_under_other(
    session: aiohttp.ClientSession,
) -> None:
    s = Service(session)
    assert isinstance(s.open(**{":method": "GET"}), PassThrough)
    assert isinstance(s.open(**{":path": "/v1/models?x=1"}), PassThrough)
    assert s.counted("passthrough") == 1
    assert s.counted("passthrough", "other") == 1


async def test_a_named_pod_gets_the_pair_of_the_connectors_kind(
    session: aiohttp.ClientSession,
) -> None:
    assert isinstance(Service(session).open(x_prefiller_host_port=str(POD)), ConcurrentPair)
    nixl = Service(session, NixlV2()).open(x_prefiller_host_port=str(POD))
    assert isinstance(nixl, SequentialPair)


async def test_no_pod_or_draining_is_decode_only(session: aiohttp.ClientSession) -> None:
    s = Service(session)
    assert isinstance(s.open(), DecodeOnly)
    s.service.draining = True
    assert isinstance(s.open(x_prefiller_host_port=str(POD)), DecodeOnly)


async def test_refusals_at_the_door(session: aiohttp.ClientSession) -> None:
    s = Service(session)
    forbidden = s.open(x_prefiller_host_port="192.168.0.1:8000")
    assert isinstance(forbidden, Rejected)
    assert status(await forbidden.request_headers()) == 403
    bad = s.open(x_prefiller_host_port="not:a:target")
    assert status(await bad.request_headers()) == 400
    s.breakers.record(POD, Verdict.DOWN)
    down = s.open(x_prefiller_host_port=str(POD))
    assert status(await down.request_headers()) == 503


async def test_a_pod_known_down_is_decode_only_when_the_policy_says_so(
    session: aiohttp.ClientSession,
) -> None:
    s = Service(session, on_bootstrap_error=BootstrapPolicy.DECODE_ONLY)
    s.breakers.record(POD, Verdict.DOWN)
    assert isinstance(s.open(x_prefiller_host_port=str(POD)), DecodeOnly)


async def test_an_unfit_request_id_is_replaced(session: aiohttp.ClientSession) -> None:
    processor = Service(session).open(x_request_id="bad id\twith tab")
    assert processor.context.request_id != "bad id\twith tab"
    assert processor.context.id_replaced


async def test_a_ledger_for_a_stream_without_request_counts_under_other(
    session: aiohttp.ClientSession,
) -> None:
    s = Service(session)
    s.service.ledger("").record(Outcome.BAD_REQUEST)
    assert s.counted("bad_request", "other") == 1


def job() -> PrefillJob:
    legs = Legs(prefill_body=Pieces((b"{}",)), decode_body=None, prefill_headers={})
    return PrefillJob(POD, legs, "req-1", PATH, 0.0, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("result", "held", "dropped"),
    [
        (PrefillResult.OK, False, False),
        (PrefillResult.CLIENT_ERROR, False, True),  # up, but its engine ids may be stale
        (PrefillResult.SERVER_ERROR, True, True),
        (PrefillResult.CONNECT_ERROR, True, False),  # says nothing about the bootstrap server
        (PrefillResult.CANCELLED, False, False),  # the client left: not the pod's fault
        (PrefillResult.INTERNAL, False, False),
        (PrefillResult.EXHAUSTED, False, False),
    ],
)
def test_what_a_prefills_outcome_teaches_about_its_pod(
    result: PrefillResult, held: bool, dropped: bool
) -> None:
    breakers = CircuitBreakers(1, 30.0)
    engines = FakeEngines()
    pod_feedback(breakers, engines)(job(), PrefillOutcome(result, 0.1))  # type: ignore[arg-type]
    assert (not breakers.allow(POD)) is held
    assert (engines.invalidated == [POD]) is dropped
