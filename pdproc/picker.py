"""Which prefill pod serves a request: a pure decision with a tagged result.

The endpoint picker's `x-prefiller-host-port` header wins when the allow list (or the pool)
admits it, and a header that names no pod (empty, or only commas) means "no disaggregation";
without the header a pool member is chosen, the one with the fewest prefills in
flight whose circuit breaker lets it be used. The caller supplies the breaker and in-flight
views as functions, so this module holds no state and does no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
class Forbidden:
    reason: str


@dataclass(frozen=True, slots=True)
class BadRequest:
    reason: str


@dataclass(frozen=True, slots=True)
class NoTarget:
    """Nobody names a prefill pod: the decode serves the request alone."""


Pick = Chosen | Unavailable | Forbidden | BadRequest | NoTarget


def pick_target(
    header: str | None,
    pool: Sequence[HostPort],
    *,
    allow: AllowList,
    in_pool: Callable[[HostPort], bool],
    breaker_allows: Callable[[HostPort], bool],
    in_flight: Callable[[HostPort], int],
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
        for member in sorted(pool, key=in_flight):
            if breaker_allows(member):
                return Chosen(member, from_pool=True)
        return Unavailable("every prefill pool member is failing")
    if not allow.allows(named) and not in_pool(named):
        return Forbidden(f"prefill target {named} is not allowed")
    if not breaker_allows(named):
        return Unavailable(f"prefill target {named} is failing (circuit open)")
    return Chosen(named)
