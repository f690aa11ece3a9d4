"""A real pdproc `Server` on a free port and a grpc.aio channel to it, playing Envoy's side
of the ext_proc stream; the prefill pod is the simulator (a real HTTP server)."""

from __future__ import annotations

from typing import Any

import httpx
from pdproc_sim import RunningPrefill

from pdproc.config import Settings
from pdproc.server import Server
from pdproc.targets import AllowList, HostPort
from tests.envoy_side import Pdproc, headers_msg, recv


class Harness(Pdproc):
    """The shared in-process pdproc, with the simulated prefill pod it sends to."""

    def __init__(self, server: Server, prefill: RunningPrefill) -> None:
        super().__init__(server)
        self.prefill = prefill

    @property
    def target(self) -> dict[str, str]:
        return {"x-prefiller-host-port": self.prefill.address}

    async def past_headers(self) -> Any:
        """A stream whose P/D request headers (aimed at the simulator) were answered."""
        call = self.open()
        await call.write(headers_msg(extra=self.target))
        await recv(call)
        return call

    async def prefill_records(self) -> list[dict[str, Any]]:
        async with httpx.AsyncClient() as client:
            response = await client.get(self.prefill.url + "/sim/requests")
            records: list[dict[str, Any]] = response.json()["requests"]
            return records

    async def faults(self, **faults: Any) -> None:
        async with httpx.AsyncClient() as client:
            response = await client.post(self.prefill.url + "/sim/faults", json=faults)
            response.raise_for_status()


def base_settings(prefill: RunningPrefill) -> Settings:
    assert prefill.bootstrap_port is not None
    return Settings(
        listen=HostPort("127.0.0.1", 0),
        mooncake_bootstrap_port=prefill.bootstrap_port,
        prefill_allow=AllowList.parse(["127.0.0.1/32", "::1/128"]),
        prefill_timeout=10.0,
        max_body_bytes=8 * 1024 * 1024,
    )
