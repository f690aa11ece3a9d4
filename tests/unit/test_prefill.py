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


class _Wire:
    """What aiohttp's writer hands the socket, one entry per write (each a syscall)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.pieces: list[object] = []

    def write(self, data: bytes | memoryview) -> None:
        self.pieces.append(data)
        self.writes.append(bytes(data))

    def writelines(self, chunks: list[bytes]) -> None:
        self.write(b"".join(chunks))

    def is_closing(self) -> bool:
        return False


async def _written(body: Pieces) -> _Wire:
    from aiohttp.base_protocol import BaseProtocol
    from aiohttp.http_writer import StreamWriter
    from multidict import CIMultiDict

    from pdproc.prefill import _SentOnce

    wire = _Wire()
    protocol = BaseProtocol(asyncio.get_running_loop())
    protocol.transport = wire  # type: ignore[assignment]
    writer = StreamWriter(protocol, asyncio.get_running_loop())
    await writer.write_headers("POST /v1/completions HTTP/1.1", CIMultiDict(host="pod"))
    sent = asyncio.get_running_loop().create_future()
    await _SentOnce(body, sent).write_with_length(writer, None)
    assert sent.done()
    return wire


async def test_a_short_prefill_body_goes_out_with_the_request_head_in_one_write() -> None:
    wire = await _written(Pieces((b'{"prompt":"hi"}',)))
    assert len(wire.writes) == 1
    assert wire.writes[0].startswith(b"POST ")
    assert wire.writes[0].endswith(b'{"prompt":"hi"}')


async def test_a_long_prompt_is_written_as_the_clients_bytes_after_the_head() -> None:
    prompt = b"x" * (1024 * 1024)
    view = memoryview(prompt)
    wire = await _written(Pieces((view, b"}")))
    assert wire.writes[0].startswith(b"POST ")
    assert wire.writes[0].endswith(b"\r\n\r\n")
    assert wire.pieces[1] is view  # handed on as the client's bytes: not joined, not copied
    assert wire.writes[2] == b"}"
