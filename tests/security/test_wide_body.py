"""A wide body: millions of tiny JSON values that pdproc refuses anyway.

`{"model":"m","x":[0,0,0,...],"y":18446744073709551616}` (16 MiB) was refused with a 400,
but only after the check had decoded the array into Python objects and walked every element
in Python: seconds of CPU with the event loop blocked and hundreds of MiB per body, so six at
once held other users' messages past Envoy's message_timeout and attack bodies reached the
decode through fail-open. Now a member's values are bounded by a byte count done in C
before it is decoded (MAX_VALUES), and what is decoded is checked by orjson's encoder, in C:
the refusal costs what a string prompt of the same size costs.

A body of hundreds of thousands of distinct top-level keys (`{"model":"m","k0":0,...}`, 8
MiB) was refused too, but only once msgspec had built the whole dict (a Python string and a
Raw per key): 0.7 s of CPU and ~150 MiB of pdproc's memory per body. Now the members are
counted in C before the decode, stopping at the bound.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

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


def distinct_keys(size: int) -> bytes:
    keys = b",".join(b'"k%d":0' % i for i in range(size // 8))
    return (b'{"model":"m",' + keys)[:size].rsplit(b",", 1)[0] + b"}"


def test_8_mib_of_distinct_keys_is_refused_before_the_members_are_built() -> None:
    raw = distinct_keys(8 * MiB)
    # The counting decoder is built at the first body with many colons, once per process
    # (~3 MiB): not this body's cost.
    with pytest.raises(BodyError):
        parse_body(distinct_keys(MiB))
    message, peak = allocated_while_parsing(raw)
    assert message == f"request body has more than {MAX_MEMBERS} top-level fields"
    # One copy of the body (the count reads it as an array); before: ~115 MiB (a dict of
    # 700,000 strings and Raws), far beyond it.
    assert peak < len(raw) + 4 * MiB


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # Duplicates are members too: a body of 5000 "a"s is no honest request.
        (b"{" + b",".join([b'"a":0'] * (MAX_MEMBERS + 1)) + b"}", "top-level fields"),
        # Colons in strings and nested objects are not top-level members.
        (
            b'{"model":"m","x":"'
            + b":" * (2 * MAX_MEMBERS)
            + b'","y":['
            + b'{"a":1},' * 5000
            + b'{"a":1}],"z":18446744073709551616}',
            "64 bits",
        ),
        # Not an object, whatever it holds.
        (b'[{"a":1}' + b',{"a":1}' * (2 * MAX_MEMBERS) + b"]", "not list"),
        # Invalid JSON within the bound is reported as such, not as too wide.
        (b'{"model":"m","x":"' + b":" * (2 * MAX_MEMBERS) + b'",}', "invalid JSON"),
    ],
)
def test_only_top_level_members_count(body: bytes, message: str) -> None:
    with pytest.raises(BodyError, match=message):
        parse_body(body)


def test_many_nested_members_are_not_top_level_ones() -> None:
    messages = b",".join([b'{"role":"user","content":"a: b, {c}"}'] * (2 * MAX_MEMBERS))
    assert len(parse_body(b'{"model":"m","messages":[' + messages + b"]}")) == 2


def test_a_nested_object_of_distinct_keys_is_bounded_by_its_values() -> None:
    keys = distinct_keys(8 * MiB)[1:]
    message, peak = allocated_while_parsing(b'{"model":"m","x":{' + keys + b"}")
    assert message == f"a request body field holds more than {MAX_VALUES} JSON values"
    assert peak < 12 * MiB  # before: accepted, after ~300 MiB of dicts and strings
    with pytest.raises(BodyError, match=f"vllm_xargs has more than {MAX_MEMBERS} fields"):
        parse_body(b'{"model":"m","vllm_xargs":' + distinct_keys(MiB) + b"}")


def test_too_many_top_level_fields_are_refused() -> None:
    fields = b",".join(b'"k%d":0' % i for i in range(MAX_MEMBERS + 1))
    with pytest.raises(BodyError, match=f"more than {MAX_MEMBERS} top-level fields"):
        parse_body(b"{" + fields + b"}")
    assert parse_body(b"{" + fields.rsplit(b",", 1)[0] + b"}")
    spaced = b" \n{ " + fields.replace(b":", b" : ").replace(b",", b" , ") + b" }\n"
    with pytest.raises(BodyError, match=f"more than {MAX_MEMBERS} top-level fields"):
        parse_body(spaced)


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


def peak_rss_since_reset(pid: int) -> int:
    """The process's peak resident memory (VmHWM, bytes) since `reset_peak_rss`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def reset_peak_rss(pid: int) -> None:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError as exc:
        pytest.skip(f"cannot reset pdproc's peak memory: {exc}")


@pytest.mark.e2e
def test_distinct_keys_through_envoy_are_a_400_at_the_cost_of_a_string_prompt(
    fresh: Stack,
) -> None:
    target = str(fresh.sim.prefill)
    pid = fresh.pdproc.popen.pid
    refused = metric(fresh, "pdproc_requests_total", outcome="bad_request")
    reset_peak_rss(pid)
    before = peak_rss_since_reset(pid)
    response = send(fresh, distinct_keys(8 * MiB), target)
    grown = peak_rss_since_reset(pid) - before
    assert response.status_code == 400, response.text
    assert response.headers.get("x-pdproc-error") == "bad_request"
    assert response.json()["message"] == (
        f"request body has more than {MAX_MEMBERS} top-level fields"
    )
    assert metric(fresh, "pdproc_requests_total", outcome="bad_request") == refused + 1
    assert records(fresh, "prefill") == []
    assert records(fresh, "decode") == []
    # A 16 MiB string prompt refused for its integer grows pdproc by ~55 MiB (the body
    # held by gRPC and the processor); the 8 MiB of keys grew it by ~150 MiB when the
    # members were built before the count. A bound with room for the machine's noise:
    assert grown < 96 * MiB, f"pdproc's peak RSS grew {grown / MiB:.0f} MiB"
    response = send(fresh, CHAT_BYTES, target)
    assert response.status_code == 200, response.text
