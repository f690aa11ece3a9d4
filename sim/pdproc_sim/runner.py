"""Start and stop simulated servers inside a running event loop."""

from __future__ import annotations

from types import TracebackType
from typing import Self

from aiohttp import web

from pdproc_sim import httpd
from pdproc_sim.decode import DecodeConfig, DecodeState, build_decode_app
from pdproc_sim.prefill import PrefillConfig, PrefillState, build_bootstrap_app, build_prefill_app


class RunningSim:
    """A started simulated server; `close()` stops it."""

    role = "base"

    def __init__(
        self, host: str, port: int, bootstrap_port: int | None, runners: list[web.AppRunner]
    ) -> None:
        self.host = host
        self.port = port
        self.bootstrap_port = bootstrap_port
        self._runners = runners

    @property
    def address(self) -> str:
        """host:port of the OpenAI server, IPv6 hosts in brackets."""
        return httpd.format_hostport(self.host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def bootstrap_address(self) -> str | None:
        if self.bootstrap_port is None:
            return None
        return httpd.format_hostport(self.host, self.bootstrap_port)

    @property
    def bootstrap_url(self) -> str | None:
        address = self.bootstrap_address
        return None if address is None else f"http://{address}"

    async def close(self) -> None:
        runners, self._runners = self._runners, []
        for runner in runners:
            await runner.cleanup()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class RunningPrefill(RunningSim):
    role = "prefill"

    def __init__(self, state: PrefillState, port: int, runners: list[web.AppRunner]) -> None:
        super().__init__(state.config.host, port, state.bootstrap_port, runners)
        self.state = state

    @property
    def engine_ids(self) -> list[str]:
        """Current engine id per dp rank (index = rank)."""
        return list(self.state.engine_ids)

    async def close(self) -> None:
        # Wake long polls and hung prefills first so the drain does not wait on them.
        self.state.shutdown()
        await super().close()


class RunningDecode(RunningSim):
    role = "decode"

    def __init__(self, state: DecodeState, port: int, runners: list[web.AppRunner]) -> None:
        super().__init__(state.config.host, port, None, runners)
        self.state = state


async def start_prefill(config: PrefillConfig | None = None) -> RunningPrefill:
    config = config or PrefillConfig()
    state = PrefillState(config)
    api_runner, port = await httpd.serve(build_prefill_app(state), config.host, config.port)
    try:
        boot_runner, boot_port = await httpd.serve(
            build_bootstrap_app(state), config.host, config.bootstrap_port
        )
    except BaseException:
        await api_runner.cleanup()
        raise
    state.bootstrap_port = boot_port
    return RunningPrefill(state, port, [api_runner, boot_runner])


async def start_decode(config: DecodeConfig | None = None) -> RunningDecode:
    config = config or DecodeConfig()
    state = DecodeState(config)
    runner, port = await httpd.serve(build_decode_app(state), config.host, config.port)
    return RunningDecode(state, port, [runner])


async def start_pair(
    prefill: PrefillConfig | None = None, decode: DecodeConfig | None = None
) -> tuple[RunningPrefill, RunningDecode]:
    running_prefill = await start_prefill(prefill)
    try:
        running_decode = await start_decode(decode)
    except BaseException:
        await running_prefill.close()
        raise
    return running_prefill, running_decode
