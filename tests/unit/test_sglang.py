"""SGLang's connector: both legs get the same body, meeting in one bootstrap room."""

from __future__ import annotations

import orjson

from pdproc.connectors import ClientRequest
from pdproc.connectors.sglang import SGLang, new_room
from pdproc.request_body import parse_body
from pdproc.targets import HostPort

from .fakes import both_legs

POD = HostPort("fd00::7", 30000)
RAW = orjson.dumps({"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True})


def request() -> ClientRequest:
    return ClientRequest("/v1/completions", RAW, parse_body(RAW), "req-1")


def test_both_legs_are_the_clients_body_with_the_rendezvous() -> None:
    connector = SGLang(8998)
    legs = both_legs(connector, request(), POD, None, {})
    assert legs.decode_body is not None
    assert bytes(legs.prefill_body) == legs.decode_body  # the same room, the same request
    sent = orjson.loads(legs.decode_body)
    assert sent["bootstrap_host"] == "fd00::7"
    assert sent["bootstrap_port"] == 8998
    assert sent["bootstrap_room"] == legs.facts["bootstrap_room"]
    # Unlike vLLM's prefill, SGLang's needs no priming: the client's fields stay.
    assert sent["max_tokens"] == 9
    assert sent["stream"] is True
    assert legs.prefill_headers == {}
    assert legs.rank is None


def test_a_streamed_body_gets_the_rendezvous_in_its_tail_and_the_prefill_the_same() -> None:
    connector = SGLang(8998)
    plan = connector.plan(POD, None, {})
    legs = connector.prefill_leg(request(), plan, None)
    assert legs.decode_body is None
    assert (
        orjson.loads(bytes(legs.prefill_body))["bootstrap_room"]
        == plan.decode_fields["bootstrap_room"]
    )


def test_rooms_are_random_below_two_to_the_63() -> None:
    rooms = {new_room() for _ in range(200)}
    assert len(rooms) == 200
    assert all(0 <= room < 2**63 for room in rooms)
