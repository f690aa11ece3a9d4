"""How loaded each prefill target is, as the picker sees it.

A request counts against the pod it was assigned to from its headers on, not only once
its prefill is running: while Envoy still sends its body, and while it waits for the pod's
bootstrap query. Otherwise "fewest in flight" sends every new request to the pod whose
query is slow or failing (its requests are not in flight yet), and they all share that
query's fate. The launcher counts a running prefill; a claim covers the time before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from pdproc.targets import HostPort


class Claim:
    """One request assigned to a target and not yet counted by the launcher."""

    __slots__ = ("_load", "target")

    def __init__(self, load: PodLoad, target: HostPort) -> None:
        self._load: PodLoad | None = load
        self.target = target

    def release(self) -> None:
        """The request launched its prefill, moved to another pod or ended (idempotent)."""
        if self._load is not None:
            self._load._release(self.target)
            self._load = None


class PodLoad:
    def __init__(self, in_flight: Callable[[HostPort], int]) -> None:
        self._in_flight = in_flight
        self._claimed: Counter[HostPort] = Counter()

    def __call__(self, target: HostPort) -> int:
        return self._in_flight(target) + self._claimed[target]

    def claim(self, target: HostPort) -> Claim:
        self._claimed[target] += 1
        return Claim(self, target)

    def _release(self, target: HostPort) -> None:
        self._claimed[target] -= 1
        if self._claimed[target] <= 0:
            del self._claimed[target]
