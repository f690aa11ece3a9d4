"""A prefill body is held only until it is written: not for the rest of the prefill.

A prefill pod answers after its compute (seconds for a long prompt); the body it was sent is
of no more use by then. pdproc must not keep megabytes per request alive for that long.
"""

from __future__ import annotations

import asyncio
import gc
import sys

import aiohttp
from aiohttp import web

from pdproc.connectors import Legs
from pdproc.metrics import Metrics
from pdproc.prefill import PrefillLauncher
from pdproc.request_body import Pieces
from pdproc.targets import HostPort


async def test_the_prefill_body_is_let_go_once_sent_while_the_pod_computes() -> None:
    received: list[int] = []
    answer = asyncio.Event()

    async def prefill(request: web.Request) -> web.Response:
        received.append(len(await request.read()))
        await answer.wait()  # the pod computes
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", prefill)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as client:
            launcher = PrefillLauncher(client, Metrics(), timeout_s=30)
            body = b'{"prompt":"' + b"x" * (4 << 20) + b'"}'
            alone = sys.getrefcount(body)  # this frame's only
            legs = Legs(prefill_body=Pieces((body,)), decode_body=body + b" ", prefill_headers={})
            job = launcher.launch(
                target=HostPort("127.0.0.1", port),
                legs=legs,
                path="/v1/completions",
                client_headers={"x-request-id": "r1"},
            )
            del legs
            for _ in range(500):  # bounded: until the pod has read it all
                if received:
                    break
                await asyncio.sleep(0.01)
            assert received == [len(body)]
            gc.collect()
            assert sys.getrefcount(body) == alone, "the prefill body outlived its sending"
            assert bytes(job.legs.prefill_body) == b""
            assert job.legs.decode_body is None
            assert not job.outcome.done()
            # What lets the client's body leave the in-flight byte budget.
            assert job.body_sent is not None
            assert job.body_sent.done()
            answer.set()
            outcome = await asyncio.wait_for(asyncio.shield(job.outcome), 30)
            assert outcome.ok
    finally:
        answer.set()
        await runner.cleanup()
