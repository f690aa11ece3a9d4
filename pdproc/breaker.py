"""Per-prefill-pod circuit breaker, so a dead pod costs one failed request, not one each.

Closed: requests flow. A connection failure (the pod is down) opens it at once; other
failures open it after `threshold` in a row. Open: the pod is skipped for a cooldown that
starts short and doubles each time a probe fails, up to `max_cooldown_s`, so a transient
hiccup costs a second, a dead pod costs one probe per cooldown. Half-open: one request is
let through as a probe and the breaker stays shut to the others meanwhile; the probe's
success closes it, its failure re-opens it. A probe whose outcome never comes just leads to
another probe after the cooldown. Pure state machine with an injected clock.

Only pods with failures have state, and at most `max_targets` of them (the least
recently failing are forgotten, i.e. closed): targets can come from a header, so their
number must not grow with what clients send. An open breaker nobody asked about for
`max_cooldown_s` after its cooldown ended is forgotten too (`forget_unasked`): without
requests there is no probe, so it says nothing about the pod any more (a worker process that
stopped getting traffic would otherwise report its pod down for ever), and the next request
is the probe it would have been.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cachetools import LRUCache

from pdproc.pod_verdict import Verdict
from pdproc.targets import HostPort

FIRST_COOLDOWN_S = 1.0


@dataclass(slots=True)
class _State:
    failures: int = 0
    open_until: float | None = None  # None: closed
    cooldown_s: float = 0.0


class _States(LRUCache[HostPort, _State]):
    """Breaker states, the least recently used dropped beyond the bound."""

    def __init__(self, maxsize: int, on_evict: Callable[[HostPort, _State], None]) -> None:
        super().__init__(maxsize)
        self._on_evict = on_evict

    def popitem(self) -> Any:
        target, state = super().popitem()
        self._on_evict(target, state)
        return target, state


class CircuitBreakers:
    def __init__(
        self,
        threshold: int,
        max_cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[HostPort, bool], None] | None = None,
        max_targets: int = 1024,
        probed: Callable[[HostPort], bool] = lambda target: False,
    ) -> None:
        """An open breaker of a `probed` target (a pool
        member) lets no client request through: pdproc probes it in the background
        (`due`, then `record` the probe's verdict), so no client pays for a probe."""
        self._probed = probed
        self._threshold = max(1, threshold)
        self._max_cooldown = max_cooldown_s
        self._clock = clock
        self._on_change = on_change
        self._states = _States(max_targets, self._evicted)
        self._open: set[HostPort] = set()

    def _evicted(self, target: HostPort, state: _State) -> None:
        if state.open_until is not None:
            self._open.discard(target)
            self._changed(target, False)

    def forget_unasked(self) -> None:
        """Close the open breakers whose cooldown ended `max_cooldown_s` ago with no probe
        (a target probed in the background is always asked about)."""
        now = self._clock()
        for target in list(self._open):
            state = self._states.get(target)
            if state is None or state.open_until is None:
                self._open.discard(target)
            elif now - state.open_until > self._max_cooldown and not self._probed(target):
                del self._states[target]
                self._open.discard(target)
                self._changed(target, False)

    def __len__(self) -> int:
        return len(self._states)

    def allow(self, target: HostPort) -> bool:
        """May a request use this target now? When half-open, only the first asker may."""
        state = self._states.get(target)
        if state is None or state.open_until is None:
            return True
        now = self._clock()
        if now < state.open_until or self._probed(target):
            return False
        state.open_until = now + state.cooldown_s
        return True

    def due(self) -> list[HostPort]:
        """The probed targets whose open breaker's cooldown ended: each is to be probed now,
        and is not due again before another cooldown (a probe that never ends retries)."""
        now = self._clock()
        targets = []
        for target in list(self._open):
            state = self._states.get(target)
            if state is None or state.open_until is None or not self._probed(target):
                continue
            if now >= state.open_until:
                state.open_until = now + state.cooldown_s
                targets.append(target)
        return targets

    def is_open(self, target: HostPort) -> bool:
        state = self._states.get(target)
        return state is not None and state.open_until is not None

    def record(self, target: HostPort, verdict: Verdict) -> None:
        """Feed what a prefill or a bootstrap query said about the pod (pdproc.pod_verdict)."""
        if verdict is Verdict.NOT_THE_POD:
            return
        state = self._states.get(target)
        if verdict.pod_is_up:
            if state is not None:
                del self._states[target]
                if state.open_until is not None:
                    self._open.discard(target)
                    self._changed(target, False)
            return
        if state is None:
            state = self._states[target] = _State()
        state.failures += 1
        was_open = state.open_until is not None
        if was_open or verdict is Verdict.DOWN or state.failures >= self._threshold:
            first = min(FIRST_COOLDOWN_S, self._max_cooldown)
            state.cooldown_s = min(state.cooldown_s * 2, self._max_cooldown) if was_open else first
            state.open_until = self._clock() + state.cooldown_s
            if not was_open:
                self._open.add(target)
                self._changed(target, True)

    def _changed(self, target: HostPort, is_open: bool) -> None:
        if self._on_change is not None:
            self._on_change(target, is_open)
