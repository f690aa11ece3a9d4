"""The body decoded into Raw members: what it refuses, and legs built from the client's bytes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproc import request_body as rb
from pdproc.connectors import ClientRequest, mooncake, nixlv2, sglang
from pdproc.gateway_fields import GATEWAY_FIELDS
from pdproc.targets import HostPort

from .fakes import both_legs, value_of

TARGET = HostPort("10.0.0.1", 8000)


@pytest.fixture(autouse=True, scope="module", params=["member-by-member", "short-whole"])
def checks(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test runs twice: with every body checked member by member (the path of long
    and wide bodies), and with the shipped threshold (a short body checked whole): one set
    of rules and messages."""
    shipped = rb.CHECKED_WHOLE_BELOW
    if request.param == "member-by-member":
        rb.CHECKED_WHOLE_BELOW = 0
    try:
        yield request.param
    finally:
        rb.CHECKED_WHOLE_BELOW = shipped


def mooncake_legs(raw: bytes, path: str = "/v1/completions") -> tuple[Any, Any]:
    request = ClientRequest(path, raw, rb.parse_body(raw))
    legs = both_legs(mooncake.Mooncake(8998), request, TARGET, {0: "e0"}, {})
    assert legs.decode_body is not None
    return json.loads(bytes(legs.prefill_body)), json.loads(legs.decode_body)


def test_members_are_slices_of_the_clients_bytes() -> None:
    raw = b'{"model": "m", "prompt": "caf\xc3\xa9 \\"q\\"", "t": 1.50, "tools": [1, {"a": 2}]}'
    members = rb.parse_body(raw)
    assert list(members) == ["model", "prompt", "t", "tools"]
    assert all(isinstance(value, msgspec.Raw) for value in members.values())
    assert bytes(members["prompt"]) == b'"caf\xc3\xa9 \\"q\\""'
    assert bytes(members["t"]) == b"1.50"
    assert value_of(members, "tools") == [1, {"a": 2}]


def test_the_prefill_leg_carries_the_clients_spelling_of_every_member_it_keeps() -> None:
    raw = (
        b'{"model":"m","prompt":"\\u00e9t\\u00e9 \\ud83d\\ude00","temperature":1.50,'
        b'"seed":18446744073709551615,"logit_bias":{"50256":-100},"max_tokens":99,'
        b'"stream":true,"stop":["\\n"]}'
    )
    request = ClientRequest("/v1/completions", raw, rb.parse_body(raw))
    legs = both_legs(mooncake.Mooncake(8998), request, TARGET, {0: "e0"}, {})
    for spelled in (
        b'"prompt":"\\u00e9t\\u00e9 \\ud83d\\ude00"',
        b'"temperature":1.50',
        b'"seed":18446744073709551615',
        b'"logit_bias":{"50256":-100}',
    ):
        assert spelled in bytes(legs.prefill_body)
        assert legs.decode_body is not None
        assert spelled in legs.decode_body
    prefill = json.loads(bytes(legs.prefill_body))
    assert (prefill["max_tokens"], prefill["stream"], prefill["ignore_eos"]) == (1, False, True)
    assert "stop" not in prefill
    # The client's member order, pdproc's additions after them.
    assert list(prefill)[:4] == ["model", "prompt", "temperature", "seed"]
    assert list(prefill)[-2:] == ["kv_transfer_params", "ignore_eos"]


@pytest.mark.parametrize("name", GATEWAY_FIELDS)
def test_a_gateway_field_given_twice_is_refused(name: str) -> None:
    for raw in (
        b'{"%s":1,"model":"m","%s":2}' % (name.encode(), name.encode()),
        b'{"%s":{"a":1},"model":"m","%s":null}' % (name.encode(), name.encode()),
    ):
        with pytest.raises(rb.BodyError, match="is set by the gateway"):
            rb.parse_body(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","prompt":"x","stream":true,"max_tokens":5,"stream":true,"max_tokens":9}',
        b'{"stream":true,"model":"m","prompt":"x","stream":false,"stream":true}',
        b'{"model":"m","prompt":"x","min_tokens":3,"min_tokens":4,"n":2,"n":3}',
    ],
)
def test_duplicate_keys_reach_the_prefill_once_and_primed(raw: bytes) -> None:
    for connector_prefill in (
        mooncake_legs(raw)[0],
        json.loads(bytes(nixlv2.prefill_body("/v1/completions", rb.parse_body(raw)))),
    ):
        assert connector_prefill["stream"] is False
        assert connector_prefill["max_tokens"] == 1
        assert "min_tokens" not in connector_prefill
        assert connector_prefill.get("n", 1) == 1
    prefill_bytes = bytes(
        mooncake.prefill_body("/v1/completions", rb.parse_body(raw), mooncake.prefill_params("x"))
    )
    # Once each, whatever a parser does with duplicates.
    assert prefill_bytes.count(b'"stream"') == 1
    assert prefill_bytes.count(b'"max_tokens"') == 1


def test_the_decode_leg_reads_duplicates_as_the_engines_do() -> None:
    """The decode carries the client's bytes; parsed as vLLM parses it (the last value
    wins), it means what pdproc checked."""
    raw = b'{"model":"m","prompt":"x","max_tokens":5,"max_tokens":9}'
    _, decode = mooncake_legs(raw)
    assert decode["max_tokens"] == 9 == value_of(rb.parse_body(raw), "max_tokens")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"prompt":"\xff"}', "invalid JSON"),
        (b'{"prompt":"\xed\xa0\x80"}', "invalid JSON"),  # a surrogate in UTF-8
        (b'{"messages":[{"content":"ok \xc3"}]}', "invalid JSON"),
        (b'{"prompt":"\\ud800"}', "invalid JSON"),  # a lone surrogate escape
        (b'{"prompt":["\\udc00"]}', "invalid JSON"),
        (b'{"prompt":"\x01"}', "invalid JSON"),
        (b'{"prompt":"\\x"}', "invalid JSON"),
        (b'{"t":NaN}', "invalid JSON"),
        (b'{"t":1e999}', "invalid JSON"),
        (b'{"t":[-1e400]}', "invalid JSON"),
        (b'{"a":1} x', "invalid JSON"),
        (b'{"a":1', "invalid JSON"),
        (b"[1, 2]", "must be a JSON object, not list"),
        (b"null", "must be a JSON object, not null"),
        (b'{"x":' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
        (b'{"x":' + b'{"a":' * 254 + b"1" + b"}" * 254 + b"}", "nested too deeply"),
        (b'{"seed":18446744073709551616}', "64 bits"),
        (b'{"x":{"y":[-9223372036854775809]}}', "64 bits"),
    ],
)
def test_refused_bodies(raw: bytes, message: str) -> None:
    with pytest.raises(rb.BodyError, match=message):
        rb.parse_body(raw)


def test_a_prompt_of_escaped_quotes_is_carried_exactly() -> None:
    prompt = b'\\"' * (256 * 1024)
    raw = b'{"model":"m","prompt":"' + prompt + b'","max_tokens":4}'
    prefill, decode = mooncake_legs(raw)
    assert prefill["prompt"] == decode["prompt"] == '"' * (256 * 1024)


def test_white_space_around_members_and_after_the_body() -> None:
    raw = b'{ "model" : "m" ,\n "prompt" : "hi" ' + b" " * 100_000 + b"}" + b"\n" * 100_000
    prefill, decode = mooncake_legs(raw)
    assert prefill["prompt"] == decode["prompt"] == "hi"
    assert (
        decode["kv_transfer_params"]["transfer_id"] == prefill["kv_transfer_params"]["transfer_id"]
    )


def test_generate_sampling_params_are_primed_member_by_member() -> None:
    raw = (
        b'{"token_ids":[1,2,3],"sampling_params":{"temperature":0.70,"max_tokens":9,'
        b'"min_tokens":4,"stop":["x"],"n":2,"seed":18446744073709551615}}'
    )
    prefill = bytes(
        mooncake.prefill_body(
            "/inference/v1/generate", rb.parse_body(raw), mooncake.prefill_params("x")
        )
    )
    sampling = json.loads(prefill)["sampling_params"]
    assert sampling == {
        "temperature": 0.7,
        "max_tokens": 1,
        "n": 1,
        "seed": 18446744073709551615,
        "ignore_eos": True,
    }
    assert b'"temperature":0.70' in prefill


def test_sampling_params_that_are_not_an_object_are_left_alone() -> None:
    raw = b'{"token_ids":[1],"sampling_params":null}'
    prefill = bytes(
        mooncake.prefill_body(
            "/inference/v1/generate", rb.parse_body(raw), mooncake.prefill_params("x")
        )
    )
    assert json.loads(prefill)["sampling_params"] is None


def test_sglang_legs_are_the_clients_bytes_with_the_room() -> None:
    raw = orjson.dumps({"model": "m", "prompt": "p" * 5000, "stream": True})
    request = ClientRequest("/v1/completions", raw, rb.parse_body(raw))
    legs = both_legs(sglang.SGLang(8998), request, TARGET, None, {})
    assert legs.decode_body is not None
    assert legs.decode_body.startswith(raw[:-1])
    assert bytes(legs.prefill_body) == legs.decode_body


@given(
    st.dictionaries(
        st.text(max_size=8),
        st.one_of(
            st.integers(-(2**63), 2**63),
            st.text(max_size=20),
            st.text(alphabet='ab"\\é', min_size=4000, max_size=5000),
            st.lists(st.integers(0, 9), max_size=3000),
            st.none(),
        ),
        max_size=5,
    )
)
def test_a_body_in_pieces_is_the_body_encoded_whole(data: dict[str, object]) -> None:
    raw = orjson.dumps(data)
    parsed: dict[str, object] = dict(rb.parse_body(raw))
    parsed["added"] = {"kv": [1, "x"]}
    pieces = rb.dump_pieces(parsed)
    assert bytes(pieces) == rb.dumps(parsed)
    assert len(pieces) == len(bytes(pieces))


def test_a_long_prompt_goes_to_the_prefill_as_a_view_of_the_clients_bytes() -> None:
    raw = orjson.dumps({"model": "m", "prompt": "p" * 100_000, "stream": True})
    request = ClientRequest("/v1/completions", raw, rb.parse_body(raw))
    legs = both_legs(mooncake.Mooncake(8998), request, HostPort("10.0.0.1", 8000), {0: "e0"}, {})
    views = [part for part in legs.prefill_body.parts if isinstance(part, memoryview)]
    assert [len(view) for view in views] == [100_002]  # the prompt, quotes included
    others = [part for part in legs.prefill_body.parts if not isinstance(part, memoryview)]
    assert all(len(part) < 4096 for part in others)


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_the_colon_bound_stops_at_the_first_past_it(kind: type[bytes] | type[bytearray]) -> None:
    # The long body's wide-object bound: exactly `bound` colons is not more than it, one
    # more is, wherever they are.
    assert not rb._holds_more(kind(b"x" * 100), b":", 3)
    assert not rb._holds_more(kind(b":a:" + b"x" * 100 + b":"), b":", 3)
    assert rb._holds_more(kind(b":a:" + b"x" * 100 + b"::"), b":", 3)
    assert rb._holds_more(kind(b"::::"), b":", 3)
    assert not rb._holds_more(kind(b""), b":", 0)
    assert rb._holds_more(kind(b":"), b":", 0)
