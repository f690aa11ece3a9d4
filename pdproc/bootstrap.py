"""Engine-id lookup: the prefill pod's Mooncake bootstrap server, queried once and cached.

The cache entry has a bounded lifetime and is dropped as soon as a prefill to that pod
fails, because a restarted pod registers new engine ids and a stale one makes every decode
wait for KV that will never come. Concurrent misses for one pod share one query.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from cachetools import TTLCache

from pdproc.metrics import Metrics
from pdproc.mooncake import BootstrapError, EngineMap, parse_engine_map
from pdproc.targets import HostPort

log = logging.getLogger(__name__)


class EngineMaps:
    def __init__(
        self,
        client: httpx.AsyncClient,
        metrics: Metrics,
        *,
        port: int,
        timeout_s: float,
        ttl_s: float,
        size: int,
        refresh_s: float = 0.0,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._port = port
        self._timeout = httpx.Timeout(timeout_s)
        self._cache: TTLCache[HostPort, EngineMap] = TTLCache(maxsize=size, ttl=ttl_s)
        self._pending: dict[HostPort, asyncio.Future[EngineMap]] = {}
        self._refresh_s = refresh_s
        self._fetched: dict[HostPort, float] = {}
        self._hit = metrics.engine_cache.labels("hit")
        self._miss = metrics.engine_cache.labels("miss")

    def bootstrap_addr(self, target: HostPort) -> str:
        """The address the decode pod is told to pull KV from (IPv6 in brackets)."""
        return target.url(self._port)

    def cached(self, target: HostPort) -> EngineMap | None:
        return self._cache.get(target)

    def prefetch(self, target: HostPort) -> None:
        """Start a lookup early (while Envoy is still sending the body) if one is needed."""
        if target not in self._cache and target not in self._pending:
            self._start_query(target)

    async def get(self, target: HostPort) -> EngineMap:
        engines = self._cache.get(target)
        if engines is not None:
            self._hit.inc()
            if (
                self._refresh_s
                and time.monotonic() - self._fetched.get(target, 0.0) > self._refresh_s
                and target not in self._pending
            ):
                # Stale-while-revalidate: this request uses the cached ids, a background
                # query picks up ids a pod registered after a restart we did not see fail.
                self._start_query(target)
            return engines
        future = self._pending.get(target) or self._start_query(target)
        # shield: one waiter going away (its stream ended) must not cancel the shared query.
        return await asyncio.shield(future)

    def invalidate(self, target: HostPort) -> None:
        self._fetched.pop(target, None)
        if self._cache.pop(target, None) is not None:
            self._metrics.engine_cache.labels("invalidation").inc()
            log.info("engine-id cache entry dropped", extra={"prefill_target": str(target)})

    def _start_query(self, target: HostPort) -> asyncio.Future[EngineMap]:
        self._miss.inc()
        task = asyncio.get_running_loop().create_task(self._query(target))
        self._pending[target] = task
        task.add_done_callback(lambda done: self._settled(target, done))
        return task

    def _settled(self, target: HostPort, task: asyncio.Future[EngineMap]) -> None:
        self._pending.pop(target, None)
        # A prefetch nobody awaited still counts as retrieved: its error reached (or will
        # reach) a request through get(), so asyncio need not report it again.
        if not task.cancelled():
            task.exception()

    async def _query(self, target: HostPort) -> EngineMap:
        url = self.bootstrap_addr(target) + "/query"
        started = time.perf_counter()
        try:
            response = await self._client.get(url, timeout=self._timeout)
        except httpx.TimeoutException:
            raise BootstrapError(f"failed to query bootstrap endpoint {url}: timed out") from None
        except httpx.ConnectError as exc:
            raise BootstrapError(
                f"failed to query bootstrap endpoint {url}: {exc!r}", pod_down=True
            ) from None
        except httpx.HTTPError as exc:
            raise BootstrapError(f"failed to query bootstrap endpoint {url}: {exc!r}") from None
        finally:
            self._metrics.bootstrap_seconds.observe(time.perf_counter() - started)
        if not 200 <= response.status_code < 300:
            raise BootstrapError(f"bootstrap endpoint {url} returned status {response.status_code}")
        engines = parse_engine_map(response.content)
        previous = self._cache.get(target)
        if previous is not None and previous != engines:
            log.info("engine ids changed", extra={"prefill_target": str(target)})
        self._cache[target] = engines
        self._fetched[target] = time.monotonic()
        if len(self._fetched) > 2 * self._cache.maxsize:
            self._fetched = {t: self._fetched[t] for t in self._cache if t in self._fetched}
        return engines
