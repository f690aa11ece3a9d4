"""A pod that never stops talking.

Earlier, pdproc read whole answers into memory (`await response.read()`): a prefill that
answered 200 and then streamed forever held the decode until the prefill timeout (504) and
grew pdproc's memory; a 100 MB `/query` answer was read whole; a million ranks were parsed,
cached and scanned on every request. Now the outcome is the status line, at most a bounded
part of any answer is read, and engine maps are bounded in bytes and ranks.

The pods here stream from generators (nothing big is allocated in the test) and stop at a
bound of their own, so a pdproc that reads on makes a test fail, never hang.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import pdproc.prefill

from .conftest import CHAT_BYTES, SECONDS, Pd
from .pods import HostilePod, MiB, Streamed, engine_map, huge_engine_map, many_ranks, padding

# What a pod may have written when pdproc hangs up: the bytes pdproc read (at most 1 MiB)
# plus what loopback socket buffers absorb (a few MiB); far below what the pods offer.
CUT_OFF = 32 * MiB


async def finished(report: Streamed) -> Streamed:
    async with asyncio.timeout(SECONDS):
        await report.finished.wait()
    return report


async def test_endless_prefill_body_is_cut_off_and_the_request_succeeds(
    pod: HostilePod, make_pdproc: Any
) -> None:
    limit = 256 * MiB
    pod.on_prefill = pod.streaming(padding(), max_bytes=limit)
    pd: Pd = await make_pdproc(pod, prefill_timeout=30.0, drain_timeout=31.0)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    # The held decode response headers were released with continue: no 504, no abort.
    assert outcome.status == 200, outcome.error
    assert outcome.disaggregated
    assert not any(a.HasField("immediate_response") for a in outcome.answers)
    (report,) = pod.streams
    await finished(report)
    assert report.disconnected, f"pdproc read all {report.sent} bytes"
    # pdproc reads 256 KiB; the rest of what the pod could write sat in socket buffers.
    assert report.sent < CUT_OFF
    assert pd.sample("pdproc_prefills_total", outcome="2xx") == 1


@pytest.mark.slow
async def test_trickling_prefill_body_does_not_hold_the_decode(
    pod: HostilePod, make_pdproc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200, then one byte every 0.2 s for up to a minute: the outcome is the status line,
    and pdproc stops reading after its drain bound (seconds), not at the pod's leisure."""
    # That there is a bound is tested here, not its length (5 s): a shorter one is not
    # waited out.
    monkeypatch.setattr(pdproc.prefill, "DRAIN_TIMEOUT_S", 0.5)
    pod.on_prefill = pod.streaming(padding(1), max_bytes=300, interval_s=0.2)
    pd: Pd = await make_pdproc(pod, prefill_timeout=30.0, drain_timeout=31.0)
    started = time.monotonic()
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert outcome.status == 200, outcome.error
    assert outcome.disaggregated
    assert time.monotonic() - started < SECONDS  # not the 30 s prefill timeout (504)
    (report,) = pod.streams
    await finished(report)
    assert report.disconnected
    assert report.sent < 300


async def test_100_mb_query_answer_is_refused_without_reading_it(
    pod: HostilePod, make_pdproc: Any
) -> None:
    total = 100 * 1000 * 1000
    pod.on_query = pod.streaming(huge_engine_map(total), max_bytes=total + MiB)
    pd: Pd = await make_pdproc(pod)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert outcome.status == 502
    assert outcome.error_kind == "bootstrap_error"
    assert outcome.error is not None
    assert "larger than" in outcome.error["message"]
    assert outcome.decode_body is None
    assert pod.hits["prefill"] == 0
    for report in pod.streams:  # the early query, and perhaps one more for the body
        await finished(report)
        assert report.disconnected, f"pdproc read all {report.sent} bytes"
        assert report.sent < CUT_OFF


async def test_a_million_ranks_are_refused_and_the_next_request_is_fast(
    pod: HostilePod, make_pdproc: Any
) -> None:
    pod.on_query = pod.streaming(many_ranks(1_000_000), max_bytes=64 * MiB)
    pd: Pd = await make_pdproc(pod)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert outcome.status == 502
    assert outcome.error_kind == "bootstrap_error"
    assert pod.hits["prefill"] == 0
    for report in pod.streams:
        await finished(report)
        assert report.disconnected
        assert report.sent < CUT_OFF
    # The pod comes back sane: the next request is served at once.
    pod.on_query = engine_map({"0": {"engine_id": "e0"}, "1": {"engine_id": "e1"}})
    started = time.monotonic()
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert outcome.disaggregated
    assert time.monotonic() - started < SECONDS


async def test_more_ranks_than_the_bound_are_refused_even_in_a_small_answer(
    pod: HostilePod, make_pdproc: Any
) -> None:
    """5,000 ranks fit in ~150 KB, under the byte bound: the rank bound refuses them."""
    pod.on_query = engine_map({str(rank): {"engine_id": f"e{rank}"} for rank in range(5000)})
    pd: Pd = await make_pdproc(pod)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert outcome.status == 502
    assert outcome.error_kind == "bootstrap_error"
    assert outcome.error is not None
    assert "ranks" in outcome.error["message"]
    assert pod.hits["prefill"] == 0
