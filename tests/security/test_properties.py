"""Anything a client can put in a body or in `x-prefiller-host-port`.

Property tests against a real pdproc in process, over gRPC, with a well-behaved hostile pod
as the prefill (so any 5xx or breaker movement is pdproc's own doing). Earlier, a deep body
gave a 502 and counted against the pod, a deep body with `kv_transfer_params` a 500, a
non-ASCII digit in the header a 500, and a long header value came back whole in the 400.

(a) Arbitrary JSON bodies: never a 5xx, never a breaker or cache change; a 400 exactly when
the oracle (json_bodies.expected) says the body cannot be carried; otherwise both legs carry
the client's values exactly, with the gateway's kv_transfer_params and only those.
(b) Arbitrary header values: 400, 403 or a valid answer (P/D to the pod, or the decode alone
when the header names nothing); never a 5xx; the answer short.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from pdproc.server import Server
from tests.envoy_side import Outcome
from tests.hypothesis_budget import examples

from .conftest import CHAT_BYTES, Pd, pd_settings
from .pods import HostilePod
from .strategies import (
    PRIMED,
    any_bodies,
    as_header,
    expected,
    header_values,
    names_nothing,
    top_level_duplicates,
)

PROPERTY = settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Background:
    """The hostile pod and pdproc on their own event loop thread, so that hypothesis can
    drive them from plain (synchronous) test functions."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.pod: HostilePod = self.run(HostilePod("e0").start())
        self.pd: Pd = self.run(self._start())

    async def _start(self) -> Pd:
        server = Server(pd_settings(self.pod))
        await server.start()
        return Pd(server)

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def play(self, body: bytes, **kw: Any) -> Outcome:
        outcome: Outcome = self.run(self.pd.play(body, **kw))
        return outcome

    def close(self) -> None:
        self.run(self.pd.stop(drain_timeout_s=5))
        self.run(self.pod.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def bg() -> Iterator[Background]:
    background = Background()
    yield background
    background.close()


def assert_untouched(bg: Background) -> None:
    """No breaker state, no open-breaker series, no engine map dropped."""
    assert len(bg.pd.service.breakers) == 0
    assert bg.pd.sample("pdproc_prefill_breaker_open") == 0
    assert bg.pd.sample("pdproc_engine_cache_events_total", event="invalidation") == 0


def prefill_body(bg: Background, transfer_id: str) -> dict[str, Any]:
    """The body the pod received for this transfer, parsed exactly (Python's json)."""
    for seen in reversed(bg.pod.prefills()):
        if transfer_id.encode() in seen.body:
            body: dict[str, Any] = json.loads(seen.body)
            return body
    raise AssertionError(f"the pod never received the prefill of {transfer_id}")


# -- (a) bodies --------------------------------------------------------------------------


@PROPERTY
@given(body=any_bodies)
@example(body=b'{"model":"m","x":' + b"[" * 300 + b"]" * 300 + b"}")
@example(body=b'{"model":"m","kv_transfer_params":{},"x":' + b"[" * 300 + b"]" * 300 + b"}")
@example(body=b'{"model":"m","seed":18446744073709551616}')
@example(body=b'{"model":"m","seed":18446744073709551615}')
@example(body=b'{"kv_transfer_param\\u0073":null}')
def test_any_body_is_a_400_or_carried_exactly_and_never_a_5xx(bg: Background, body: bytes) -> None:
    verdict, client = expected(body)
    event(verdict)
    prefills = len(bg.pod.prefills())
    outcome = bg.play(body, prefill=bg.pod.address)
    assert outcome.status < 500, (outcome.status, outcome.error)
    assert_untouched(bg)
    if verdict == "400":
        assert_refused_untouched(bg, outcome, prefills)
    elif verdict == "pd":
        assert client is not None
        params = assert_decode_carried_exactly(outcome, client)
        assert_prefill_carried_exactly(bg, params, client)


def assert_refused_untouched(bg: Background, outcome: Outcome, prefills: int) -> None:
    """A 400 of its own kind; the decode got nothing and the pod no prefill."""
    assert outcome.status == 400, outcome.decode_body
    assert outcome.error_kind == "bad_request"
    assert outcome.decode_body is None
    assert len(bg.pod.prefills()) == prefills


def assert_decode_carried_exactly(outcome: Outcome, client: dict[str, Any]) -> dict[str, Any]:
    """The decode: the client's object, exactly, plus the gateway's params, once; returns
    those params."""
    assert outcome.status == 200, outcome.error
    assert outcome.decode_body is not None
    params = outcome.kv_params
    assert params is not None
    assert params["do_remote_prefill"] is True
    assert params["remote_engine_id"] == "e0"
    assert str(params["transfer_id"]).startswith("xfer-")
    assert top_level_duplicates(outcome.decode_body) == []
    assert json.loads(outcome.decode_body) == {**client, "kv_transfer_params": params}
    return params


def assert_prefill_carried_exactly(
    bg: Background, params: dict[str, Any], client: dict[str, Any]
) -> None:
    """The prefill: the client's values exactly, primed to one token."""
    prefill = prefill_body(bg, params["transfer_id"])
    assert prefill["kv_transfer_params"] == {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "transfer_id": params["transfer_id"],
    }
    assert (prefill["max_tokens"], prefill["stream"], prefill["ignore_eos"]) == (1, False, True)
    for key, value in client.items():
        if key not in PRIMED:
            assert prefill[key] == value, key


# -- (b) x-prefiller-host-port -----------------------------------------------------------


@st.composite
def header_cases(draw: st.DrawFn, pod_port: int) -> tuple[bytes | str, bool]:
    encoding = draw(st.sampled_from(["utf-8", "latin-1", "metadata"]))
    value = as_header(draw(header_values(pod_port)), encoding)
    return value, encoding == "metadata"


def test_any_prefiller_header_gets_400_403_or_a_valid_answer(bg: Background) -> None:
    @settings(PROPERTY, max_examples=examples(250))
    @given(case=header_cases(bg.pod.port))
    @example(case=(b"10.0.0.1:80\xb2", False))
    @example(case=("10.0.0.1:80\u00b2", True))
    @example(case=(b"[fe80::1%eth0]:80", False))
    @example(case=(b"9" * 50_000, False))
    @example(case=(f" http://127.0.0.1:{bg.pod.port}/ ,10.0.0.1:1".encode(), False))
    @example(case=(b" , ,", False))
    def check(case: tuple[bytes | str, bool]) -> None:
        value, single_message = case
        hits = bg.pod.hits["prefill"]
        outcome = bg.play(CHAT_BYTES, prefill=value, single_message=single_message)
        assert outcome.status in (200, 400, 403), (outcome.status, outcome.error)
        assert len(outcome.raw_error) < 1024
        assert_untouched(bg)
        assert_refusal_kind(outcome)
        assert_pod_contacted_only_for_pd(bg, outcome, hits, value)

    check()


def assert_refusal_kind(outcome: Outcome) -> None:
    if outcome.status == 400:
        assert outcome.error_kind == "bad_request"
    elif outcome.status == 403:
        assert outcome.error_kind == "forbidden"


def assert_pod_contacted_only_for_pd(
    bg: Background, outcome: Outcome, hits: int, value: bytes | str
) -> None:
    """A refusal contacted nobody; a P/D answer prefilled once at the pod the header named;
    a 200 without P/D is the decode alone, with the client's bytes, for a header naming
    nothing."""
    if outcome.status != 200:
        assert bg.pod.hits["prefill"] == hits  # nobody was contacted
    elif outcome.disaggregated:
        assert outcome.kv_params is not None
        bootstrap = f"http://127.0.0.1:{bg.pod.bootstrap_port}"
        assert outcome.kv_params["remote_bootstrap_addr"] == bootstrap
        assert bg.pod.hits["prefill"] == hits + 1
    else:  # no target named: the decode alone, with the client's bytes
        assert names_nothing(value)
        assert outcome.decode_body == CHAT_BYTES


UNPRINTABLE = {
    "c1-controls": (b"\x80" * 70 + b":80", False),
    "c1-bracket": (b"[" + b"\x85" * 70 + b"]:80", False),
    "astral-metadata": ("\U000e0001" * 70 + ":80", True),
}


@pytest.mark.parametrize("case", list(UNPRINTABLE.values()), ids=list(UNPRINTABLE))
def test_400_message_for_a_bad_header_is_under_300_bytes(
    bg: Background, case: tuple[bytes | str, bool]
) -> None:
    value, single_message = case
    outcome = bg.play(CHAT_BYTES, prefill=value, single_message=single_message)
    assert outcome.status == 400
    assert outcome.error is not None
    assert len(outcome.error["message"].encode()) < 300, outcome.error["message"]
