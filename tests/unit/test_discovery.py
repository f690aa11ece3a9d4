"""DNS discovery of prefill pods. The resolver is injected here: no DNS server that could
serve several records for one name runs in this sandbox (the e2e test resolves a real name)."""

from __future__ import annotations

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
            import asyncio

            await asyncio.sleep(0.01)
        assert pool.members == (HostPort("10.0.0.9", 8000),)
    finally:
        await pool.stop()


async def test_system_resolver_resolves_localhost() -> None:
    assert "127.0.0.1" in await system_resolver("localhost", 80)
