"""Background probes of pool members whose breaker is open.

A pool member's open breaker lets no client request through (pdproc.breaker): instead,
once its cooldown ends, pdproc asks the pod itself whether it serves again, `GET /health`
on its prefill port and, for a connector that pairs with engine ids (Mooncake), a fresh
bootstrap `/query` (whose map is then cached). Both answering closes the breaker; anything
else re-opens it for a doubled cooldown (up to --breaker-cooldown). A probe is bounded by
--bootstrap-timeout, and a pod that answers badly is read no further than a status line.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from pdproc.breaker import CircuitBreakers
from pdproc.engine_maps import BootstrapError, EngineMaps
from pdproc.metrics import Metrics
from pdproc.pod_http import locally_exhausted
from pdproc.pod_verdict import Verdict
from pdproc.targets import HostPort

log = logging.getLogger(__name__)

PROBE_TICK_S = 0.25


class Prober:
    def __init__(
        self,
        client: aiohttp.ClientSession,
        breakers: CircuitBreakers,
        metrics: Metrics,
        *,
        timeout_s: float,
        engines: EngineMaps | None,
    ) -> None:
        self._client = client
        self._breakers = breakers
        self._metrics = metrics
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._engines = engines  # None: the connector needs no engine map
        self._running: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Probe what is due, for ever (cancelled at shutdown with its probes)."""
        try:
            while True:
                for target in self._breakers.due():
                    task = asyncio.get_running_loop().create_task(self._probe(target))
                    self._running.add(task)
                    task.add_done_callback(self._running.discard)
                await asyncio.sleep(PROBE_TICK_S)
        finally:
            for task in list(self._running):
                task.cancel()

    async def _probe(self, target: HostPort) -> None:
        verdict = await self.verdict(target)
        self._metrics.probes.labels("up" if verdict.pod_is_up else "down").inc()
        log.info(
            "prefill pod probed: %s",
            verdict.value,
            extra={"prefill_target": str(target), "probe": verdict.value},
        )
        self._breakers.record(target, verdict)

    async def verdict(self, target: HostPort) -> Verdict:
        """What the pod's health endpoint (and bootstrap server) say about it now."""
        health = await self._health(target)
        if health is not Verdict.HEALTHY or self._engines is None:
            return health
        try:
            await self._engines.query_now(target)
        except BootstrapError as exc:
            return exc.verdict
        return Verdict.HEALTHY

    async def health(self, target: HostPort) -> Verdict:
        """What the pod's health endpoint alone says (bounded by --bootstrap-timeout)."""
        return await self._health(target)

    async def _health(self, target: HostPort) -> Verdict:
        try:
            async with self._client.get(
                target.url() + "/health", timeout=self._timeout, allow_redirects=False
            ) as response:
                return Verdict.HEALTHY if 200 <= response.status < 300 else Verdict.FAILED
        except TimeoutError:
            return Verdict.DOWN
        except (aiohttp.ClientError, OSError) as exc:
            return Verdict.NOT_THE_POD if locally_exhausted(exc) else Verdict.DOWN
