"""Fixtures of the gRPC-level tests: a simulated prefill pod and pdproc servers on it.
A module may override `prefill` (its timing) or `h` (its settings)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest
from pdproc_sim import PrefillConfig, RunningPrefill, start_prefill

from pdproc.server import Server

from .harness import Harness, base_settings


@pytest.fixture
async def prefill() -> AsyncIterator[RunningPrefill]:
    running = await start_prefill(PrefillConfig(dp_ranks=2, prefill_delay_ms=50))
    yield running
    await running.close()


@pytest.fixture
async def make_harness(
    prefill: RunningPrefill,
) -> AsyncIterator[Callable[..., Any]]:
    started: list[Harness] = []

    async def make(**overrides: Any) -> Harness:
        server = Server(replace(base_settings(prefill), **overrides))
        await server.start()
        harness = Harness(server, prefill)
        started.append(harness)
        return harness

    yield make
    for harness in started:
        if not harness.stopped:
            await harness.stop(drain_timeout_s=5)


@pytest.fixture
async def h(make_harness: Callable[..., Any]) -> Harness:
    harness: Harness = await make_harness()
    return harness
