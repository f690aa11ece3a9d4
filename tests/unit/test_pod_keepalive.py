"""pdproc lets go of an idle pod connection before the pod would: vLLM's HTTP server
(uvicorn) closes a keep-alive connection after 5 s idle, and a prefill sent on a connection
the pod is closing fails with a disconnect the pod did not cause (and would be blamed for)."""

from __future__ import annotations

import asyncio

from pdproc.pod_http import POD_KEEPALIVE_S, new_session
from tests.waiting import eventually_async

ENGINE_KEEP_ALIVE_S = 5.0  # uvicorn's default, which vLLM keeps (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)


async def test_an_idle_pod_connection_is_closed_by_pdproc_first() -> None:
    assert POD_KEEPALIVE_S < ENGINE_KEEP_ALIVE_S
    opened: list[int] = []
    closed_by_client: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A pod that never closes an idle connection itself: whoever closes it is pdproc.
        number = len(opened)
        opened.append(number)
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                closed_by_client.append(number)
                break
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with new_session(4) as session:
            url = f"http://127.0.0.1:{port}/health"
            async with session.get(url) as response:
                assert await response.read() == b"ok"
            await eventually_async(lambda: closed_by_client == [0])
            async with session.get(url) as response:
                assert await response.read() == b"ok"
            assert opened == [0, 1]  # the next request opened a fresh connection
    finally:
        server.close()
        await server.wait_closed()
