"""Which prefill pod serves a request: a pure decision with a tagged result.

The endpoint picker's `x-prefiller-host-port` header wins when the allow list (or the pool)
admits it, and a header that names no pod (empty, or only commas) means "no disaggregation";
without the header a pool member is chosen (`choose_member`): of the members whose circuit
breaker lets them be used, one of the least loaded (its prefills in flight plus the requests
assigned to it that wait for its bootstrap query or their body), chosen among equals by
`tie` (in turn, from a random start: `Rotation`, so equal pods share the work in each
process, and processes and replicas, starting apart, need no shared state). The caller
supplies the breaker and load views as functions, so this module holds no state and does no
I/O; a routing policy (e.g. one that prefers the pod holding a prompt's prefix) slots in as
`tie`, or in place of `choose_member`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from pdproc.targets import AllowList, HostPort, TargetError, target_from_header


@dataclass(frozen=True, slots=True)
class Chosen:
    target: HostPort
    from_pool: bool = False  # pdproc's own choice, not the endpoint picker's


@dataclass(frozen=True, slots=True)
class Unavailable:
    """A target exists but its breaker is open (or the whole pool's are): the request is
    rejected or served decode-only, as `--on-bootstrap-error` says."""

    reason: str


@dataclass(frozen=True, slots=True)
class Unproven(Unavailable):
    """A header-named target that never answered, on a host whose such targets are failing
    (pdproc.unproven): handled as Unavailable, and counted apart."""


@dataclass(frozen=True, slots=True)
class Forbidden:
    reason: str


@dataclass(frozen=True, slots=True)
class BadRequest:
    reason: str


@dataclass(frozen=True, slots=True)
class NoTarget:
    """Nobody names a prefill pod: the decode serves the request alone."""


Pick = Chosen | Unproven | Unavailable | Forbidden | BadRequest | NoTarget
Tie = Callable[[Sequence[HostPort]], HostPort]


class Rotation:
    """A tie rule: the next of the equals each time, from a random start (its only state is
    a counter, so a pick stays a function of the members, their load and this turn)."""

    def __init__(self, start: int | None = None) -> None:
        self._turn = random.randrange(1 << 16) if start is None else start

    def __call__(self, equal: Sequence[HostPort]) -> HostPort:
        self._turn += 1
        return equal[self._turn % len(equal)]


def choose_member(
    members: Sequence[HostPort],
    *,
    usable: Callable[[HostPort], bool],
    load: Callable[[HostPort], int],
    tie: Tie = random.choice,
    excluded: Collection[HostPort] = (),
) -> HostPort | None:
    """One of the least loaded usable members not in `excluded`; None when none is usable."""
    candidates = [m for m in dict.fromkeys(members) if m not in excluded and usable(m)]
    if not candidates:
        return None
    loads = [load(m) for m in candidates]
    least = min(loads)
    return tie([m for m, n in zip(candidates, loads, strict=True) if n == least])


def pick_target(
    header: str | None,
    pool: Sequence[HostPort],
    *,
    allow: AllowList,
    in_pool: Callable[[HostPort], bool],
    breaker_allows: Callable[[HostPort], bool],
    load: Callable[[HostPort], int],
    tie: Tie = random.choice,
    unproven_allows: Callable[[HostPort], bool] = lambda target: True,
) -> Pick:
    try:
        named = target_from_header([header]) if header is not None else None
    except TargetError as exc:
        return BadRequest(str(exc))
    if named is None:
        if header is not None or not pool:
            # A header that names no pod (empty, blanks, commas) is an endpoint picker's
            # "no disaggregation", as in llm-d: the decode serves the request alone.
            return NoTarget()
        member = choose_member(pool, usable=breaker_allows, load=load, tie=tie)
        if member is None:
            return Unavailable("every prefill pool member is failing")
        return Chosen(member, from_pool=True)
    if not allow.allows(named) and not in_pool(named):
        return Forbidden(f"prefill target {named} is not allowed")
    if not breaker_allows(named):
        return Unavailable(f"prefill target {named} is failing (circuit open)")
    if not unproven_allows(named):
        return Unproven(
            f"prefill target {named} has never answered, and ports of {named.url_host} that "
            "never answered are failing (circuit open)"
        )
    return Chosen(named)
