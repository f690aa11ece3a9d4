"""The per-host breaker of header-named ports that never answered (pdproc.unproven)."""

from __future__ import annotations

from typing import Any

from pdproc.pod_verdict import Verdict
from pdproc.targets import HostPort
from pdproc.unproven import UnprovenPorts

MEMBER = HostPort("10.0.0.1", 8000)
REAL = HostPort("10.0.0.1", 8001)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def ports(threshold: int = 3, max_targets: int = 16) -> tuple[UnprovenPorts, Clock, list[Any]]:
    clock = Clock()
    changes: list[Any] = []
    unproven = UnprovenPorts(
        threshold,
        30.0,
        is_member=lambda target: target == MEMBER,
        max_targets=max_targets,
        clock=clock,
        on_change=lambda host, is_open: changes.append((host, is_open)),
    )
    return unproven, clock, changes


def tarpit(port: int) -> HostPort:
    return HostPort("10.0.0.1", 9000 + port)


def test_failures_of_many_unproven_ports_open_their_hosts_breaker() -> None:
    unproven, _, changes = ports()
    unproven.record(REAL, Verdict.HEALTHY)
    for port in range(2):
        unproven.record(tarpit(port), Verdict.FAILED)
    assert unproven.allow(tarpit(99))
    unproven.record(tarpit(2), Verdict.DOWN)  # one failure, not an open breaker at once
    assert changes == [("10.0.0.1", True)]
    assert not unproven.allow(tarpit(99))
    assert unproven.allow(REAL)
    assert unproven.allow(MEMBER)
    assert unproven.allow(HostPort("10.0.0.2", 9000))  # another host


def test_proven_ports_and_members_neither_count_nor_close_it() -> None:
    unproven, _, _ = ports()
    unproven.record(REAL, Verdict.HEALTHY)
    for _ in range(5):
        unproven.record(REAL, Verdict.FAILED)
        unproven.record(MEMBER, Verdict.DOWN)
    assert unproven.allow(tarpit(0))
    assert not unproven.is_open("10.0.0.1")
    for port in range(3):
        unproven.record(tarpit(port), Verdict.FAILED)
    # The real pod's answers cannot keep the tarpit's breaker closed.
    unproven.record(REAL, Verdict.HEALTHY)
    unproven.record(MEMBER, Verdict.HEALTHY)
    unproven.record(tarpit(5), Verdict.REFUSED)
    assert unproven.is_open("10.0.0.1")


def test_a_new_ports_first_2xx_closes_it_after_the_cooldown() -> None:
    unproven, clock, changes = ports()
    for port in range(3):
        unproven.record(tarpit(port), Verdict.FAILED)
    clock.now = 1.5
    assert unproven.allow(tarpit(7))  # the probe
    assert not unproven.allow(tarpit(8))
    unproven.record(tarpit(7), Verdict.HEALTHY)
    assert changes == [("10.0.0.1", True), ("10.0.0.1", False)]
    assert unproven.allow(tarpit(8))
    assert not unproven.unproven(tarpit(7))


def test_state_is_bounded() -> None:
    unproven, _, changes = ports(max_targets=4)
    for host in range(10):
        for port in range(3):
            unproven.record(HostPort(f"10.1.0.{host}", 9000 + port), Verdict.FAILED)
        unproven.record(HostPort(f"10.2.0.{host}", 8000), Verdict.HEALTHY)
    assert len(unproven) == 4
    opened = sum(1 if is_open else -1 for _, is_open in changes)
    assert opened == 4  # the forgotten ones were closed with their gauge
    assert sum(not unproven.unproven(HostPort(f"10.2.0.{h}", 8000)) for h in range(10)) == 4


async def test_a_refused_real_pod_is_proven_by_its_health_check_despite_hanging_checks() -> None:
    """Tarpit ports fill the host's health checks and hang; once they have run past
    PREEMPT_AFTER_S a real pod's refusal takes the oldest one's place, its check answers and
    it is let through, while the host's breaker stays open for the tarpits."""
    import asyncio

    from pdproc import unproven as module

    unproven, clock, _ = ports()
    hang = asyncio.Event()
    asked: list[HostPort] = []

    async def health(target: HostPort) -> Verdict:
        asked.append(target)
        if target != REAL:
            await hang.wait()  # accepts, never answers
        return Verdict.HEALTHY

    unproven.health = health
    for i in range(3):
        unproven.record(tarpit(i), Verdict.FAILED)
    tarpits = [tarpit(100 + i) for i in range(module.CHECKS_PER_HOST)]
    for target in tarpits:
        assert not unproven.allow(target)
    assert not unproven.allow(REAL)  # every check is young: none is given up yet
    await asyncio.sleep(0)
    assert REAL not in asked
    clock.now += module.PREEMPT_AFTER_S + 0.01
    assert not unproven.allow(REAL)  # refused, and its check replaces the oldest
    for _ in range(3):
        await asyncio.sleep(0)
    assert REAL in asked
    assert unproven.allow(REAL)
    assert not unproven.allow(tarpit(200))
    hang.set()
