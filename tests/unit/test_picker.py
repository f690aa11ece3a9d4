"""Which prefill pod serves a request: the picker's pure decision, on every kind of header
and pool (pdproc.picker)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import pytest

from pdproc.picker import (
    BadRequest,
    Chosen,
    Forbidden,
    NoTarget,
    Pick,
    Rotation,
    Unavailable,
    choose_member,
    pick_target,
)
from pdproc.targets import AllowList, HostPort

A = HostPort("10.0.0.1", 8000)
B = HostPort("10.0.0.2", 8000)
ALLOWED = AllowList.parse(["10.0.0.0/24"])


def pick(
    header: str | None,
    pool: Sequence[HostPort] = (),
    *,
    allow: AllowList = ALLOWED,
    down: frozenset[HostPort] = frozenset(),
    in_flight: Callable[[HostPort], int] = lambda _: 0,
    tie: Callable[[Sequence[HostPort]], HostPort] = lambda equal: equal[0],
) -> Pick:
    return pick_target(
        header,
        pool,
        allow=allow,
        in_pool=lambda target: target in pool,
        breaker_allows=lambda target: target not in down,
        load=in_flight,
        tie=tie,
    )


def test_the_endpoint_pickers_choice_is_kept() -> None:
    assert pick("10.0.0.2:8000", [A]) == Chosen(B, from_pool=False)


def test_the_first_entry_of_a_list_is_the_target() -> None:
    assert pick(" , 10.0.0.1:8000, 10.0.0.2:8000") == Chosen(A)


@pytest.mark.parametrize("header", ["", " ", ",", " , "])
def test_a_header_naming_no_pod_means_no_disaggregation(header: str) -> None:
    assert pick(header, [A]) == NoTarget()


def test_no_header_and_no_pool_is_no_disaggregation() -> None:
    assert pick(None) == NoTarget()


def test_the_pool_member_with_fewest_prefills_in_flight_is_chosen() -> None:
    busy = {A: 3, B: 1}
    assert pick(None, [A, B], in_flight=busy.__getitem__) == Chosen(B, from_pool=True)


def test_a_pool_member_whose_breaker_is_open_is_skipped() -> None:
    busy = {A: 3, B: 1}
    chosen = pick(None, [A, B], down=frozenset({B}), in_flight=busy.__getitem__)
    assert chosen == Chosen(A, from_pool=True)


def test_a_pool_all_failing_is_unavailable() -> None:
    assert isinstance(pick(None, [A, B], down=frozenset({A, B})), Unavailable)


def test_a_malformed_header_is_the_clients_error() -> None:
    assert isinstance(pick("not a host:port:x"), BadRequest)


def test_a_target_outside_the_allow_list_is_forbidden() -> None:
    result = pick("192.168.1.1:8000", allow=AllowList.parse([]))
    assert isinstance(result, Forbidden)
    assert "192.168.1.1" in result.reason


def test_a_pool_member_is_allowed_without_the_allow_list() -> None:
    assert pick("10.0.0.1:8000", [A], allow=AllowList.parse([])) == Chosen(A)


def test_a_named_target_whose_breaker_is_open_is_unavailable() -> None:
    assert isinstance(pick("10.0.0.1:8000", down=frozenset({A})), Unavailable)


def test_ties_are_broken_by_the_tie_rule_among_the_least_loaded_only() -> None:
    c = HostPort("10.0.0.3", 8000)
    seen: list[Sequence[HostPort]] = []

    def last(equal: Sequence[HostPort]) -> HostPort:
        seen.append(list(equal))
        return equal[-1]

    busy = {A: 1, B: 1, c: 2}
    assert pick(None, [A, B, c], in_flight=busy.__getitem__, tie=last) == Chosen(B, True)
    assert seen == [[A, B]]


def test_equal_idle_members_share_the_work_by_default() -> None:
    c = HostPort("10.0.0.3", 8000)
    chosen = Counter(
        choose_member([A, B, c], usable=lambda _: True, load=lambda _: 0) for _ in range(600)
    )
    assert set(chosen) == {A, B, c}
    assert min(chosen.values()) >= 150  # each of 3 gets ~200 of 600; 150 is > 6 sigma off


def test_excluded_members_are_never_chosen() -> None:
    assert choose_member([A, B], usable=lambda _: True, load=lambda _: 0, excluded={A}) == B
    assert choose_member([A], usable=lambda _: True, load=lambda _: 0, excluded={A}) is None


def test_a_rotation_gives_equal_members_equal_turns() -> None:
    c = HostPort("10.0.0.3", 8000)
    rotation = Rotation(start=0)
    chosen = Counter(
        choose_member([A, B, c], usable=lambda _: True, load=lambda _: 0, tie=rotation)
        for _ in range(60)
    )
    assert chosen == {A: 20, B: 20, c: 20}
