"""The prefill launcher's accounting (pdproc.prefill): every launched prefill ends in one
outcome, counted, and leaves the in-flight counts, however it ends."""

from __future__ import annotations

import asyncio

import aiohttp

from pdproc.connectors import Legs
from pdproc.metrics import Metrics
from pdproc.outcomes import PrefillResult
from pdproc.prefill import PrefillJob, PrefillLauncher, PrefillOutcome
from pdproc.request_body import Pieces
from pdproc.targets import HostPort

# Nothing listens there, and nothing is sent: the prefill is cancelled before it starts.
POD = HostPort("127.0.0.1", 9)


async def test_a_prefill_cancelled_before_it_started_is_counted_and_forgotten() -> None:
    """A stream that ends in the same loop turn as its launch (its write and read both fail
    at once) cancels a task that never ran: its outcome must still be settled."""
    seen: list[tuple[PrefillJob, PrefillOutcome]] = []
    metrics = Metrics()
    async with aiohttp.ClientSession() as session:
        launcher = PrefillLauncher(
            session, metrics, timeout_s=5.0, on_outcome=lambda j, o: seen.append((j, o))
        )
        legs = Legs(prefill_body=Pieces((b"{}",)), decode_body=None, prefill_headers={}, rank=0)
        job = launcher.launch(
            target=POD, legs=legs, path="/v1/completions", client_headers={}, keep_answer=False
        )
        assert launcher.in_flight(POD) == 1
        assert job.task is not None
        job.task.cancel()
        async with asyncio.timeout(5):
            outcome = await job.outcome
        await asyncio.sleep(0)  # the outcome's callbacks
    assert outcome.outcome is PrefillResult.CANCELLED
    assert job.body_sent is not None
    assert job.body_sent.done()  # never sent: nothing held
    assert launcher.in_flight(POD) == 0
    assert launcher.in_flight_by_rank(POD) == {}
    assert metrics.prefills.labels("cancelled")._value.get() == 1
    assert [o.outcome for _, o in seen] == [PrefillResult.CANCELLED]
