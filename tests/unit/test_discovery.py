"""DNS discovery of prefill pods, with the resolver injected (fake answers, a hanging server)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from pdproc.discovery import DnsPool, system_resolver
from pdproc.targets import HostPort

NAME = HostPort("prefill.ns.svc", 8000)


class Records:
    def __init__(self) -> None:
        self.answers: list[Sequence[str] | OSError] = []
        self.calls = 0

    async def __call__(self, name: str, port: int) -> Sequence[str]:
        assert (name, port) == (NAME.host, NAME.port)
        self.calls += 1
        answer = self.answers[min(self.calls, len(self.answers)) - 1]
        if isinstance(answer, OSError):
            raise answer
        return answer


async def test_every_record_is_a_member_and_changes_are_followed() -> None:
    records = Records()
    records.answers = [["10.0.0.1", "10.0.0.2", "FD00::3"], ["10.0.0.2", "10.0.0.4"]]
    pool = DnsPool([NAME], 3600, records)
    await pool.start()
    try:
        assert pool.members == (
            HostPort("10.0.0.1", 8000), HostPort("10.0.0.2", 8000), HostPort("fd00::3", 8000),
        )  # fmt: skip
        await pool.refresh()  # a scale-down and a new pod
        assert pool.members == (HostPort("10.0.0.2", 8000), HostPort("10.0.0.4", 8000))
    finally:
        await pool.stop()


@pytest.mark.parametrize("failure", [OSError("SERVFAIL"), []])
async def test_failed_or_empty_lookup_keeps_the_last_good_set(failure: object) -> None:
    records = Records()
    records.answers = [["10.0.0.1"], failure]  # type: ignore[list-item]
    pool = DnsPool([NAME], 3600, records)
    await pool.refresh()
    await pool.refresh()
    assert pool.members == (HostPort("10.0.0.1", 8000),)


async def test_background_refresh_runs() -> None:
    records = Records()
    records.answers = [["10.0.0.1"], ["10.0.0.9"]]
    pool = DnsPool([NAME], 0.01, records)
    await pool.start()
    try:
        for _ in range(500):
            if pool.members == (HostPort("10.0.0.9", 8000),):
                break
            await asyncio.sleep(0.01)
        assert pool.members == (HostPort("10.0.0.9", 8000),)
    finally:
        await pool.stop()


async def test_system_resolver_resolves_localhost() -> None:
    assert "127.0.0.1" in await system_resolver("localhost", 80)


class Hanging:
    """A resolver that never answers until released: a dead DNS server."""

    def __init__(self) -> None:
        self.started = 0
        self.release = asyncio.Event()
        self.answer: list[str] = ["10.0.0.7"]

    async def __call__(self, name: str, port: int) -> Sequence[str]:
        self.started += 1
        await self.release.wait()
        return self.answer


async def test_a_hanging_lookup_is_bounded_reused_and_counted() -> None:
    records = Records()
    records.answers = [["10.0.0.1"]]
    outcomes: list[str] = []
    pool = DnsPool([NAME], 3600, records, timeout_s=0.05, on_lookup=outcomes.append)
    await pool.refresh()
    hanging = Hanging()
    pool._resolver = hanging  # the resolver dies after the first answer
    await pool.refresh()
    await pool.refresh()
    # Each refresh gave up at its timeout, kept the last good set, and the second did not
    # start a lookup next to the one still hanging.
    assert pool.members == (HostPort("10.0.0.1", 8000),)
    assert outcomes == ["ok", "timeout", "timeout"]
    assert hanging.started == 1
    hanging.release.set()  # the late answer is taken by the next refresh
    await asyncio.sleep(0)
    await pool.refresh()
    assert pool.members == (HostPort("10.0.0.7", 8000),)
    assert outcomes[-1] == "ok"
    await pool.stop()


async def test_refreshes_keep_their_period_while_the_resolver_hangs() -> None:
    hanging = Hanging()
    outcomes: list[str] = []
    pool = DnsPool([NAME], 0.05, hanging, on_lookup=outcomes.append)
    await pool.start()
    try:
        for _ in range(500):
            if len(outcomes) >= 4:
                break
            await asyncio.sleep(0.01)
        # Refreshes went on (each ending in a timeout) with one lookup outstanding.
        assert outcomes[:4] == ["timeout"] * 4
        assert hanging.started == 1
    finally:
        await pool.stop()


async def test_failures_are_counted_by_outcome() -> None:
    records = Records()
    records.answers = [OSError("SERVFAIL"), [], ["10.0.0.1"]]
    outcomes: list[str] = []
    pool = DnsPool([NAME], 3600, records, on_lookup=outcomes.append)
    for _ in range(3):
        await pool.refresh()
    assert outcomes == ["error", "empty", "ok"]


async def test_the_lookup_timeout_is_shorter_than_the_period() -> None:
    pool = DnsPool([NAME], 1.0, Hanging(), timeout_s=5.0)
    assert pool._timeout_s < 1.0
