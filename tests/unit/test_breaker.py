from __future__ import annotations

from pdproc.breaker import CircuitBreakers
from pdproc.pod_verdict import Verdict
from pdproc.targets import HostPort

POD = HostPort("10.0.0.1", 8000)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_connection_failure_opens_at_once_then_one_probe() -> None:
    clock = Clock()
    changes: list[bool] = []
    breakers = CircuitBreakers(5, 10.0, clock, lambda _, is_open: changes.append(is_open))
    assert breakers.allow(POD)
    breakers.record(POD, Verdict.DOWN)
    assert breakers.is_open(POD)
    assert not breakers.allow(POD)
    clock.now += 1.0  # the first cooldown is short: a transient hiccup costs a second
    assert breakers.allow(POD)  # the probe
    assert not breakers.allow(POD)  # everyone else waits for it
    breakers.record(POD, Verdict.HEALTHY)
    assert breakers.allow(POD)
    assert changes == [True, False]


def test_cooldown_doubles_while_the_pod_stays_down_up_to_the_maximum() -> None:
    clock = Clock()
    breakers = CircuitBreakers(5, 5.0, clock)
    breakers.record(POD, Verdict.DOWN)
    waits = []
    for _ in range(5):
        waited = 0.0
        while not breakers.allow(POD):
            clock.now += 0.25
            waited += 0.25
        waits.append(waited)
        breakers.record(POD, Verdict.DOWN)  # the probe fails too
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_other_failures_open_after_threshold_in_a_row() -> None:
    breakers = CircuitBreakers(3, 10.0, Clock())
    for _ in range(2):
        breakers.record(POD, Verdict.FAILED)
    assert breakers.allow(POD)
    breakers.record(POD, Verdict.HEALTHY)  # resets the run
    for _ in range(2):
        breakers.record(POD, Verdict.FAILED)
    assert breakers.allow(POD)
    breakers.record(POD, Verdict.FAILED)
    assert not breakers.allow(POD)


def test_lost_probe_leads_to_another_probe() -> None:
    clock = Clock()
    breakers = CircuitBreakers(1, 5.0, clock)
    breakers.record(POD, Verdict.FAILED)
    clock.now += 1.0
    assert breakers.allow(POD)  # a probe whose outcome never came
    assert not breakers.allow(POD)
    clock.now += 1.0
    assert breakers.allow(POD)  # leads to another probe, not a stuck breaker


def test_client_errors_do_not_count_against_the_pod() -> None:
    breakers = CircuitBreakers(2, 10.0, Clock())
    for _ in range(5):
        breakers.record(POD, Verdict.REFUSED)
    assert breakers.allow(POD)


def test_an_open_breaker_nobody_asks_about_is_forgotten() -> None:
    """No requests, no probe: after its cooldown and `max_cooldown_s` more, an open breaker
    is closed (its gauge with it), and the next request is the probe."""
    clock = Clock()
    changes: list[bool] = []
    breakers = CircuitBreakers(5, 10.0, clock, lambda _, is_open: changes.append(is_open))
    breakers.record(POD, Verdict.DOWN)
    clock.now += 1.0 + 10.0  # the 1 s cooldown, then max_cooldown_s
    breakers.forget_unasked()
    assert changes == [True]  # not closed yet: strictly longer
    clock.now += 0.1
    breakers.forget_unasked()
    assert changes == [True, False]
    assert len(breakers) == 0


def test_an_open_breaker_with_requests_is_kept() -> None:
    clock = Clock()
    breakers = CircuitBreakers(5, 10.0, clock)
    breakers.record(POD, Verdict.DOWN)
    for _ in range(30):  # the pod stays down; requests keep probing it
        clock.now += 1.0
        if breakers.allow(POD):
            breakers.record(POD, Verdict.DOWN)
        breakers.forget_unasked()
        assert breakers.is_open(POD)


def test_a_probed_target_lets_no_client_through_and_is_due_for_its_probe() -> None:
    clock = Clock()
    breakers = CircuitBreakers(1, 30.0, clock=clock, probed=lambda target: target == POD)
    breakers.record(POD, Verdict.DOWN)
    assert breakers.due() == []  # still cooling down
    clock.now += 1.5
    assert not breakers.allow(POD)  # no client request is the probe
    assert breakers.due() == [POD]
    assert breakers.due() == []  # being probed: not due again before another cooldown
    breakers.record(POD, Verdict.DOWN)  # the probe failed: doubled cooldown
    clock.now += 1.5
    assert breakers.due() == []
    clock.now += 1.0
    assert breakers.due() == [POD]
    breakers.record(POD, Verdict.HEALTHY)  # the probe found it back
    assert breakers.allow(POD)


def test_a_probed_target_is_never_forgotten_unasked() -> None:
    clock = Clock()
    breakers = CircuitBreakers(1, 2.0, clock=clock, probed=lambda target: True)
    breakers.record(POD, Verdict.DOWN)
    clock.now += 100
    breakers.forget_unasked()
    assert breakers.is_open(POD)
