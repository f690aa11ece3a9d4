"""Prefill target parsing (x-prefiller-host-port) and the SSRF allow list."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproc.targets import AllowList, HostPort, TargetError, parse_host_port, target_from_header


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("10.0.0.1:8000", HostPort("10.0.0.1", 8000)),
        ("Prefill-0.NS.svc:8000", HostPort("prefill-0.ns.svc", 8000)),
        ("[fd00::1]:8000", HostPort("fd00::1", 8000)),
        ("[::1]:1", HostPort("::1", 1)),
        ("http://10.0.0.1:8000/", HostPort("10.0.0.1", 8000)),
        ("  10.0.0.2:9 ", HostPort("10.0.0.2", 9)),
    ],
)
def test_parse_host_port(value: str, expected: HostPort) -> None:
    assert parse_host_port(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "10.0.0.1",
        "fd00::1:8000",
        "[fd00::1]",
        "[nothex]:80",
        "host:0",
        "host:65536",
        "host:x",
        ":80",
        "a b:80",
        "user@host:80",
        "host/path:80",
        "[fd00::1]8000",
    ],
)
def test_parse_host_port_rejects(value: str) -> None:
    with pytest.raises(TargetError):
        parse_host_port(value)


def test_ipv6_urls_have_brackets() -> None:
    target = parse_host_port("[fd00::1]:8000")
    assert target.url() == "http://[fd00::1]:8000"
    assert target.url(8998) == "http://[fd00::1]:8998"
    assert str(target) == "[fd00::1]:8000"


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (["a:1"], HostPort("a", 1)),
        (["a:1,b:2"], HostPort("a", 1)),
        ([" a:1 , b:2"], HostPort("a", 1)),
        (["", "b:2"], HostPort("b", 2)),
        ([",b:2"], HostPort("b", 2)),
        ([""], None),
        ([" , "], None),
        ([], None),
        (["[::1]:5,a:1"], HostPort("::1", 5)),
    ],
)
def test_target_from_header(values: list[str], expected: HostPort | None) -> None:
    assert target_from_header(values) == expected


def test_allow_list_cidrs_hosts_and_any_port() -> None:
    allow = AllowList.parse(["10.244.0.0/16", "valid-pod", "fd00::/64", "Other.NS.svc"])
    assert allow.allows(HostPort("10.244.1.100", 8000))
    assert allow.allows(HostPort("10.244.1.100", 1))
    assert allow.allows(HostPort("valid-pod", 8000))
    assert allow.allows(HostPort("other.ns.svc", 8000))
    assert allow.allows(HostPort("fd00::5", 8000))
    assert not allow.allows(HostPort("10.0.0.1", 8000))
    assert not allow.allows(HostPort("evil-pod", 8000))
    assert not allow.allows(HostPort("fd01::5", 8000))
    assert not allow.allows(HostPort("malicious.example.com", 8080))


def test_host_names_are_never_matched_by_cidr() -> None:
    # A name is not resolved: "localhost" is not 127.0.0.1 for the allow list.
    assert not AllowList.parse(["127.0.0.0/8"]).allows(HostPort("localhost", 80))


def test_empty_allow_list_allows_nothing_and_star_allows_all() -> None:
    assert not AllowList.parse([]).allows(HostPort("10.0.0.1", 80))
    assert AllowList.parse(["*"]).allows(HostPort("anything", 80))


def test_allow_list_rejects_garbage() -> None:
    with pytest.raises(TargetError):
        AllowList.parse(["10.0.0.0/33x"])


@given(st.text(max_size=80))
def test_any_header_text_is_a_target_or_a_target_error(value: str) -> None:
    """Header values are client input: never anything but a target or a 400."""
    try:
        target: HostPort | TargetError = parse_host_port(value)
    except TargetError as exc:
        target = exc
    if isinstance(target, TargetError):
        assert len(str(target)) < 200  # what is echoed back is bounded
        return
    assert 0 < target.port < 65536
    assert target.host.isascii()
    assert parse_host_port(str(target)) == target


@pytest.mark.parametrize(
    "value",
    ["10.0.0.1:80\u00b2", "10.0.0.1:\u0968\u0966", "[fe80::1%eth0]:80", "ex\u00e4mple:80"],
)
def test_non_ascii_digits_and_zone_ids_are_rejected(value: str) -> None:
    with pytest.raises(TargetError):
        parse_host_port(value)


def test_a_huge_header_value_is_not_echoed_whole() -> None:
    with pytest.raises(TargetError) as caught:
        parse_host_port("x" * 50_000)
    assert len(str(caught.value)) < 200
