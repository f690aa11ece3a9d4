"""Engine-id lookup: the prefill pod's Mooncake bootstrap server, queried and cached.

The bootstrap server listens on one port per pod, so its answer depends on the pod's host
alone: the cache is keyed by host, whatever port a request names.

No pairing uses a map that may be stale. A restarted pod registers new engine ids, and a
decode told an id that no longer exists waits silently for vLLM's abort timeout (480 s). A
real engine takes 30 s and more to restart (loading the model), so a map whose query was
sent less than `max_age_s` ago (kept well under that) names engines that are still the
pod's, or that are gone with the pod itself, in which case its prefill fails loudly. An
older map is never used: the request waits for a fresh query, and every request waiting
for that query gets its answer. A map in use is re-queried in the background once older
than `refresh_s`, so a busy pod's requests rarely wait. A failed prefill drops the pod's
map at once (at most once a second). This holds in each process and each replica on its
own; with --workers a map one process dropped or found changed is not used by the others
either (`siblings`: pdproc.multiprocess.siblings). Concurrent queries for one pod are one
query. Answers are read up to a bound and redirects are not followed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from cachetools import TTLCache
from opentelemetry.trace import Span, SpanKind

from pdproc.connectors import EngineMap
from pdproc.errors import shown
from pdproc.metrics import Metrics
from pdproc.multiprocess.siblings import Siblings
from pdproc.pod_http import locally_exhausted, peer_gone, read_at_most
from pdproc.pod_verdict import Verdict, of_bootstrap
from pdproc.targets import HostPort
from pdproc.telemetry import ATTR_CACHE, ATTR_ENGINES, ATTR_TARGET, Tracing, fail

log = logging.getLogger(__name__)

MIN_REFETCH_S = 1.0


# Bounds on a bootstrap server's answer: a prefill pod is trusted to be a prefill pod, not
# to be small. A real one has a handful of ranks and answers in a few hundred bytes.
MAX_QUERY_BYTES = 1024 * 1024
MAX_RANKS = 1024
MAX_ENGINE_ID_CHARS = 256


class BootstrapError(Exception):
    """The bootstrap server's answer cannot be used; `verdict` says what that says about the
    pod (pdproc.pod_verdict): `DOWN` when the server could not even be reached, `NOT_THE_POD`
    when pdproc itself ran out of resources (descriptors, memory), else `FAILED`."""

    def __init__(self, message: str, verdict: Verdict = Verdict.FAILED) -> None:
        super().__init__(message)
        self.verdict = verdict


def parse_engine_map(payload: bytes) -> EngineMap:
    """Parse `GET /query`: `{"<dp_rank>": {"engine_id": "<id>", "worker_addr": {...}}, ...}`.

    Ranks whose `engine_id` is a string are kept (a rank still registering may have none);
    a null rank is skipped; any other value means we misunderstand the server, so the whole
    answer is refused, as llm-d does. Keys must be integers: vLLM parses the rank header with
    `int()` and would silently ignore anything else, sending the prefill to a random rank.
    """
    engines: EngineMap = {}
    for key, entry in _query_object(payload).items():
        engine_id = _rank_engine_id(key, entry)
        if engine_id is not None:
            engines[int(key)] = engine_id
    if not engines:
        raise BootstrapError("engine_id not found in bootstrap response")
    return engines


def _query_object(payload: bytes) -> dict[str, Any]:
    """The answer as a JSON object of at most MAX_RANKS ranks, or BootstrapError."""
    if len(payload) > MAX_QUERY_BYTES:
        raise BootstrapError(f"bootstrap response larger than {MAX_QUERY_BYTES} bytes")
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise BootstrapError(f"failed to parse bootstrap response: {exc}") from None
    if not isinstance(data, dict):
        raise BootstrapError("failed to parse bootstrap response: not a JSON object")
    if len(data) > MAX_RANKS:
        raise BootstrapError(f"bootstrap response lists more than {MAX_RANKS} ranks")
    return data


def _rank_engine_id(key: str, entry: object) -> str | None:
    """One rank's engine id; None for a rank to skip (null, no id yet, key not an integer)."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise BootstrapError(
            f"failed to parse bootstrap response: rank {shown(key)} is not an object"
        )
    engine_id = entry.get("engine_id")
    if not isinstance(engine_id, str) or not engine_id:
        return None
    if len(engine_id) > MAX_ENGINE_ID_CHARS:
        raise BootstrapError("failed to parse bootstrap response: engine_id too long")
    if not (key.isascii() and key.isdigit()):
        return None
    return engine_id


class EngineMaps:
    def __init__(
        self,
        client: aiohttp.ClientSession,
        metrics: Metrics,
        *,
        port: int,
        timeout_s: float,
        max_age_s: float,
        size: int,
        refresh_s: float = 0.0,
        tracing: Tracing | None = None,
        clock: Callable[[], float] = time.monotonic,
        siblings: Siblings | None = None,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._port = port
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_age = max_age_s
        self._clock = clock
        self._siblings = siblings
        # host -> (engine map, when its query was sent, the same in wall-clock time for the
        # siblings). The TTL only bounds memory: age is checked against the query's start,
        # which the TTL (from the answer) outlives.
        self._cache: TTLCache[str, tuple[EngineMap, float, float]] = TTLCache(
            maxsize=size, ttl=max_age_s, timer=clock
        )
        self._pending: dict[str, asyncio.Future[EngineMap]] = {}
        self._refresh_s = refresh_s
        self._tracing = tracing or Tracing(None)
        self._hit = metrics.engine_cache.labels("hit")
        self._miss = metrics.engine_cache.labels("miss")

    def _usable(self, host: str) -> tuple[EngineMap, float] | None:
        """The pod's map if it is young enough to pair with, and its age."""
        entry = self._cache.get(host)
        if entry is None:
            return None
        age = self._clock() - entry[1]
        if age >= self._max_age:
            return None
        if self._siblings is not None and self._siblings.stale(host, entry[2]):
            return None  # another worker found it stale after this map was queried
        return entry[0], age

    def prefetch(self, target: HostPort, span: Span | None = None) -> None:
        """Start a lookup early (while Envoy is still sending the body) if one is needed."""
        if target.host not in self._pending and self._usable(target.host) is None:
            self._start_query(target, span)

    async def get(self, target: HostPort, span: Span | None = None) -> EngineMap:
        usable = self._usable(target.host)
        if usable is not None:
            self._hit.inc()
            engines, age = usable
            if self._refresh_s and age > self._refresh_s and target.host not in self._pending:
                # Still young enough to pair with; the answer replaces it for later requests.
                self._start_query(target)
            return engines
        # Missing or too old: wait for a query sent now (or a moment ago), whose answer
        # every request waiting here gets.
        future = self._pending.get(target.host) or self._start_query(target, span)
        # shield: one waiter going away (its stream ended) must not cancel the shared query.
        return await asyncio.shield(future)

    async def query_now(self, target: HostPort) -> EngineMap:
        """A fresh answer from the pod's bootstrap server (a probe), cached like any."""
        future = self._pending.get(target.host) or self._start_query(target)
        return await asyncio.shield(future)

    def learn(self, target: HostPort, verdict: Verdict) -> None:
        """Act on what a prefill said about its pod: a pod that may have restarted is asked
        again next time."""
        if verdict.map_may_be_stale:
            self.invalidate(target)

    def invalidate(self, target: HostPort) -> None:
        """Forget the pod's map, unless it was fetched within the last second: failures
        come in bursts (and a client can aim them at a pod's other ports), but one fresh
        map per second is enough to follow a restart."""
        entry = self._cache.get(target.host)
        if entry is None or self._clock() - entry[1] < MIN_REFETCH_S:
            return
        if self._cache.pop(target.host, None) is not None:
            self._metrics.engine_cache.labels("invalidation").inc()
            log.info("engine-id cache entry dropped", extra={"prefill_target": str(target)})
            if self._siblings is not None:
                self._siblings.mark_stale(target.host)

    def _start_query(
        self, target: HostPort, parent: Span | None = None
    ) -> asyncio.Future[EngineMap]:
        self._miss.inc()
        span = self._tracing.child_span(parent, "pdproc.bootstrap", SpanKind.CLIENT)
        task = asyncio.get_running_loop().create_task(self._traced_query(target, span))
        self._pending[target.host] = task
        task.add_done_callback(lambda done: self._settled(target.host, done))
        return task

    def _settled(self, host: str, task: asyncio.Future[EngineMap]) -> None:
        self._pending.pop(host, None)
        # A prefetch nobody awaited still counts as retrieved: its error reached (or will
        # reach) a request through get(), so asyncio need not report it again.
        if not task.cancelled():
            task.exception()

    async def _traced_query(self, target: HostPort, span: Span | None) -> EngineMap:
        if span is None:
            return await self._query(target)
        span.set_attribute(ATTR_TARGET, str(target))
        span.set_attribute(ATTR_CACHE, "miss")
        try:
            engines = await self._query(target)
        except BootstrapError as exc:
            fail(span, str(exc))
            raise
        else:
            span.set_attribute(ATTR_ENGINES, len(engines))
            return engines
        finally:
            span.end()

    async def _query(self, target: HostPort) -> EngineMap:
        url = target.url(self._port) + "/query"
        sent, sent_wall = self._clock(), time.time()
        started = time.perf_counter()
        try:
            async with self._client.get(
                url, timeout=self._timeout, allow_redirects=False
            ) as response:
                status = response.status
                payload = await read_at_most(response.content, MAX_QUERY_BYTES)
        except aiohttp.ConnectionTimeoutError:
            # Not even a connection (a silent node, a partition): the pod is down.
            raise BootstrapError(
                f"failed to query bootstrap endpoint {url}: connect timed out",
                of_bootstrap(reached=False, local=False),
            ) from None
        except TimeoutError:
            # Connected, then no answer in --bootstrap-timeout: a failure, counted toward
            # the breaker's threshold (a slow moment must not shut a pod off at once).
            raise BootstrapError(f"failed to query bootstrap endpoint {url}: timed out") from None
        except (aiohttp.ClientError, OSError) as exc:
            if locally_exhausted(exc):
                raise BootstrapError(
                    f"pdproc is out of resources ({exc}): bootstrap endpoint {url} not queried",
                    of_bootstrap(reached=False, local=True),
                ) from None
            if isinstance(exc, aiohttp.ClientConnectorError) or peer_gone(exc):
                raise BootstrapError(
                    f"failed to query bootstrap endpoint {url}: {exc}",
                    of_bootstrap(reached=False, local=False),
                ) from None
            raise BootstrapError(
                f"failed to query bootstrap endpoint {url}: {type(exc).__name__}"
            ) from None
        finally:
            self._metrics.bootstrap_seconds.observe(time.perf_counter() - started)
        if not 200 <= status < 300:
            raise BootstrapError(f"bootstrap endpoint {url} returned status {status}")
        engines = parse_engine_map(payload)
        previous = self._cache.get(target.host)
        if previous is not None and previous[0] != engines:
            # A map this young should not change (a restart takes longer): requests paired
            # with it just now may wait for vLLM's abort timeout in their decode.
            log.warning(
                "engine ids changed within %.1f s of the previous query: the prefill pod "
                "restarted faster than --engine-cache-ttl assumes",
                sent - previous[1],
                extra={"prefill_target": str(target)},
            )
            if self._siblings is not None:
                # This map is the news, not what the mark retires.
                sent_wall = self._siblings.mark_stale(target.host)
        self._cache[target.host] = (engines, sent, sent_wall)
        return engines
