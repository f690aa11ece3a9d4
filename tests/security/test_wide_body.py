"""A wide body: millions of tiny JSON values that pdproc refuses anyway.

`{"model":"m","x":[0,0,0,...],"y":18446744073709551616}` (16 MiB) was refused with a 400,
but only after the check had decoded the array into Python objects and walked every element
in Python: seconds of CPU with the event loop blocked and hundreds of MiB per body, so six at
once held other users' messages past Envoy's message_timeout and attack bodies reached the
decode through fail-open. Now a member's values are bounded by a byte count done in C
before it is decoded (MAX_VALUES), and what is decoded is checked by orjson's encoder, in C:
the refusal costs what a string prompt of the same size costs.
"""

from __future__ import annotations

import tracemalloc

import pytest
from pdproc_sim.devstack import Stack

from pdproc.request_body import MAX_MEMBERS, MAX_VALUES, BodyError, parse_body, values_bound
from tests.stacks import records, served

from .conftest import CHAT_BYTES, metric, send

MiB = 1024 * 1024
WIDE_INT = b'"y":18446744073709551616}'


def wide(item: bytes, size: int) -> bytes:
    count = size // (len(item) + 1)
    return b'{"model":"m","x":[' + b",".join([item] * count) + b"]," + WIDE_INT


def allocated_while_parsing(raw: bytes) -> tuple[str, int]:
    """parse_body's 400 message and the peak of what it allocated (bytes)."""
    tracemalloc.start()
    try:
        with pytest.raises(BodyError) as refused:
            parse_body(raw)
        return str(refused.value), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("item", [b"0", b"{}", b"[]", b'""', b"1.5"])
def test_a_16_mib_wide_array_is_refused_without_decoding_it(item: bytes) -> None:
    message, peak = allocated_while_parsing(wide(item, 16 * MiB))
    assert message == f"a request body field holds more than {MAX_VALUES} JSON values"
    # Before: 580-730 MiB (every element a Python object, then a Python walk over them).
    assert peak < 4 * MiB


def test_a_string_prompt_of_the_same_size_costs_the_same() -> None:
    raw = b'{"model":"m","prompt":"' + b"x" * (16 * MiB) + b'",' + WIDE_INT
    message, peak = allocated_while_parsing(raw)
    assert "does not fit in 64 bits" in message
    assert peak < 4 * MiB


def test_the_bound_counts_every_value_at_least_once() -> None:
    import msgspec

    for text in (b"[]", b"[0]", b"[0,1,[2,{}]]", b'{"a":[1,2],"b":{"c":3}}', b'["a,b"]'):
        decoded = msgspec.json.decode(text)
        values = 0
        pending = [decoded]
        while pending:
            item = pending.pop()
            values += 1
            if isinstance(item, dict):
                pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)
        assert values_bound(msgspec.Raw(text)) >= values
        # What lets a member shorter than MAX_VALUES bytes go uncounted.
        assert values_bound(msgspec.Raw(text)) <= len(text) + 1


def test_a_member_just_past_the_bound_in_bytes_is_counted() -> None:
    # [0,0,...] of MAX_VALUES values (about 2 * MAX_VALUES bytes) counts MAX_VALUES + 1:
    # refused; one value fewer (still far longer than MAX_VALUES bytes) passes.
    assert parse_body(b'{"x":[' + b",".join([b"0"] * (MAX_VALUES - 1)) + b"]}")
    with pytest.raises(BodyError, match="JSON values"):
        parse_body(b'{"x":[' + b",".join([b"0"] * MAX_VALUES) + b"]}")


def test_values_up_to_the_bound_are_checked_exactly() -> None:
    tokens = b",".join([b"7"] * (MAX_VALUES - 1))
    assert parse_body(b'{"model":"m","prompt":[' + tokens + b"]}")
    with pytest.raises(BodyError, match="64 bits"):
        parse_body(b'{"model":"m","prompt":[' + tokens[:-2] + b",18446744073709551616]}")
    with pytest.raises(BodyError, match="nested too deeply"):
        parse_body(b'{"model":"m","x":' + b"[" * 254 + b"]" * 254 + b"}")
    assert parse_body(b'{"model":"m","x":' + b"[" * 253 + b"]" * 253 + b"}")


def test_too_many_top_level_fields_are_refused() -> None:
    fields = b",".join(b'"k%d":0' % i for i in range(MAX_MEMBERS + 1))
    with pytest.raises(BodyError, match=f"more than {MAX_MEMBERS} top-level fields"):
        parse_body(b"{" + fields + b"}")
    assert parse_body(b"{" + fields.rsplit(b",", 1)[0] + b"}")


@pytest.mark.e2e
def test_a_wide_array_through_envoy_is_a_400_that_reaches_no_pod(fresh: Stack) -> None:
    target = str(fresh.sim.prefill)
    refused = metric(fresh, "pdproc_requests_total", outcome="bad_request")
    for item in (b"0", b"{}"):
        response = send(fresh, wide(item, 4 * MiB), target)
        assert response.status_code == 400, response.text
        assert response.headers.get("x-pdproc-error") == "bad_request"
        assert "JSON values" in response.json()["message"]
    assert metric(fresh, "pdproc_requests_total", outcome="bad_request") == refused + 2
    assert records(fresh, "prefill") == []
    assert records(fresh, "decode") == []
    # The next user is disaggregated as before.
    response = send(fresh, CHAT_BYTES, target)
    assert response.status_code == 200, response.text
    served(fresh, "prefill", 1)
    served(fresh, "decode", 1)
